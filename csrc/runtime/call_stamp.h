// A call's stamp (moe_ep/comm/call_check.py): kind, call number, the handle's call, size, status,
// reason, int32 each. A normal-mode notify kernel sends its rank's stamp to every rank inside its
// count row, and hands every source's stamp to the host with the counts; the host compares them
// (call_check.verify), so ranks that make different calls, or a rank that rejected its input, make
// every rank raise. Host and device.
#pragma once

namespace moe_ep {

constexpr int kStampWords = 6;
constexpr int kStampStatus = 4;  // the status word: 0, or why the rank rejected its input
constexpr int kStampBadIds = 3;  // call_check.STATUS: BadExpertIdError (set by the notify kernel itself)

}  // namespace moe_ep
