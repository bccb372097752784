#!/usr/bin/env python3
"""Fill the frameworks folder that tests/test_frameworks_v2.py, test_frameworks_low_latency.py and
test_frameworks_hybrid.py read ($MOE_EP_FRAMEWORKS, default <repo>/.frameworks, git-ignored) with only the
files those tests use.

The wheels of Megatron-Core 0.19.2, torchtitan 0.3.0, vLLM 0.33.0 and SGLang 0.5.23 and of the
dependencies their tested code paths import are fetched with
`pip download --no-deps --only-binary=:all: --python-version X` (the frameworks with
--ignore-requires-python: Megatron-Core 0.19.2 asks for Python 3.12, and the parts the tests import are
pure Python). From each wheel only the files in KEEP are unpacked, the frameworks at the top of the
folder, their dependencies in its deps/ folder, plus each kept package's __init__.py files, each
distribution's METADATA headers and entry_points.txt (importlib.metadata reads them) and the libraries
vendored next to compiled modules (`<dist>.libs/`). Shared objects are stripped (`strip --strip-unneeded`)
when `strip` is on PATH.

KEEP is data: the files the CPU tests imported or opened in their worker processes, recorded once by
running them over the fully unpacked wheels (sorted `m.__file__ for m in sys.modules.values()` and the
files opened or dlopen'ed under the folder, written at each process's exit; that tracing is not part of
the repository), plus what is found without being opened: the libraries tvm_ffi's module links
(deps/tvm_ffi/lib) and SGLang's JIT kernel sources (sglang/kernels/jit/csrc and include, whose presence
sglang.kernels.jit checks at import). Re-record it when a framework or dependency version changes.

A compiled dependency (pydantic_core, msgspec, ...) comes as the wheel for --python-version, so fill the
folder for the Python that will read it. The GPU machine runs Python 3.12 and its image already holds
tokenizers 0.23.2 and safetensors 0.8.0 (the versions pinned here; it imports them from its own
site-packages), so for it

    python tests/fetch_frameworks.py --python-version 3.12 --leave-out tokenizers safetensors --out .frameworks

gives 59.4 MiB of files (68 MiB with those two) to name in the device call's carry. --training-only
fetches Megatron-Core and torchtitan alone (what .ci/run does: the vLLM wheel alone is ~340 MB). Exit
status 1, the folder untouched, when pip cannot give the wheels.
"""
from __future__ import annotations

import argparse
import fnmatch
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]

# distributions unpacked at the top of the folder; every other wheel goes to deps/
FRAMEWORKS = ("megatron_core", "torchtitan", "vllm", "sglang")
TRAINING = ("megatron-core==0.19.2", "torchtitan==0.3.0")
# torchtitan's light dependencies (those .ci/run fetched before this script)
TRAINING_DEPS = ("spmd_types==0.2.3", "tyro==1.0.17", "docstring-parser==0.18.0", "shtab==1.13.0",
                 "typeguard==4.6.1")
SERVING = ("vllm==0.33.0", "sglang==0.5.23")
# what vLLM's and SGLang's tested paths import (docs/deep_ep_compat.md), at the versions KEEP was recorded with
SERVING_DEPS = (
    "annotated-types==0.8.0", "anyio==4.16.0", "apache-tvm-ffi==0.1.15.post2", "cachetools==8.0.2", "cbor2==6.3.0",
    "certifi==2026.10.19.post1", "charset-normalizer==3.5.3", "cloudpickle==3.1.3", "dill==0.4.1",
    "einops==0.8.2", "filelock==4.3.1", "h11==0.16.0", "httpcore2==2.16.2", "httpx2==2.16.2",
    "huggingface-hub==2.4.0", "idna==3.20", "msgspec==0.23.0", "openai==3.57.0", "openai-harmony==0.0.8",
    "orjson==3.13.0", "packaging==26.4", "partial-json-parser==0.2.1.1.post7", "prometheus-client==0.26.0",
    "psutil==7.2.2", "py-cpuinfo==9.0.0", "pybase64==1.5.1", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "pyyaml==6.0.4", "pyzmq==27.3.0", "regex==2026.11.19", "requests==2.34.2", "safetensors==0.8.0",
    "sniffio==1.3.1", "tokenizers==0.23.2", "transformers==5.19.0", "typing-inspection==0.4.5", "urllib3==2.8.0",
)
# Files kept, relative to the folder. A line "DIR: NAME ..." keeps DIR/NAME for each NAME, a glob within
# DIR ("NAME" alone means NAME.py), and an indented line lists more NAMEs of the DIR above; any other
# line is a pattern: "DIR/**/*.py" keeps every .py file under DIR, "DIR/**" every file.
KEEP = """
deps/annotated_types: __init__
deps/anyio: __init__ _lazyimport lowlevel to_thread
deps/anyio/_core: __init__ _eventloop _exceptions _resources _tasks _typedattr
deps/anyio/abc: __init__ _resources _streams _tasks
deps/anyio/streams: __init__ tls
deps/cachetools: __init__ keys
deps/cbor2: __init__ _cbor2.*.so
deps/certifi: __init__ core
deps/charset_normalizer: __init__ api cd.*.so constant legacy md.*.so models utils version
deps/cloudpickle: __init__ cloudpickle
deps/cpuinfo: __init__ cpuinfo
deps/dill: __info__ __init__ _dill _shims detect logger objtypes pointers session settings source temp
deps/docstring_parser: __init__ attrdoc common epydoc google numpydoc parser rest util
deps/einops: __init__ _backends einops packing parsing
deps/filelock: __init__ version
deps/filelock/_core/**/*.py
deps/filelock/_filesystem: __init__ _exchange _files _ownership
deps/filelock/_identity/**/*.py
deps/filelock/_native/**/*.py
deps/filelock/_soft: __init__ _records
deps/filelock/_soft/_exclusive/**/*.py
deps/h11: __init__ _abnf _connection _events _headers _readers _receivebuffer _state _util _version _writers
deps/httpcore2: __init__ _api _exceptions _models _ssl _synchronization _trace _types _utils
deps/httpcore2/_async: __init__ connection connection_pool http11 http_proxy interfaces
deps/httpcore2/_backends: __init__ anyio auto base mock sync
deps/httpcore2/_sync: __init__ connection connection_pool http11 http_proxy interfaces
deps/httpx2: __init__ __version__ _alias _api _auth _client _config _content _cookies _decoders _exceptions
    _models _multipart _sse _status_codes _types _urlparse _urls _utils
deps/httpx2/_transports/**/*.py
deps/huggingface_hub: __init__ _commit_api _eval_results _inference_endpoints _jobs_api _local_folder
    _revision _snapshot_download _space_api _tree_cache community constants dataclasses
    errors file_download hf_api lfs repocard repocard_data
deps/huggingface_hub/serialization: __init__ _base _torch
deps/huggingface_hub/utils: __init__ _auth _chunk_utils _datetime _detect_agent _experimental _fixes _headers
    _hf_uris _http _lfs _oauth_device _pagination _paths _runtime _safetensors
    _shared_blobs _typing _validators _xet _xet_progress_reporting endpoint_helpers
    insecure_hashlib logging sha tqdm
deps/idna: __init__ core idnadata intranges package_data
deps/msgspec: __init__ _core.*.so _json_schema _typing_utils _utils _version inspect json msgpack structs toml
    yaml
deps/openai: __init__ _base_client _client _compat _constants _data_residency _exceptions _files _httpx2
    _legacy_response _models _module_client _provider _qs _response _streaming _streaming_cleanup
    _types _version version
deps/openai/_utils/**/*.py
deps/openai/_vendor: __init__
deps/openai/_vendor/httpx_aiohttp: client
deps/openai/auth/**/*.py
deps/openai/lib: __init__ _bedrock_auth _client_auth _old_api _pydantic _tools azure bedrock
deps/openai/lib/_parsing: __init__ _completions
deps/openai/providers/**/*.py
deps/openai/types: __init__ audio_model audio_response_format auto_file_chunking_strategy_param batch
    batch_create_params batch_error batch_list_params batch_request_counts batch_usage
    chat_model completion completion_choice completion_create_params completion_usage
    container_create_params container_create_response container_list_params
    container_list_response container_retrieve_response content_provenance_check
    content_provenance_check_create_params create_embedding_response decision
    decision_create_params decision_input_image_param decision_input_message_param
    decision_input_part_union_param decision_input_text_param
    decision_prompt_cache_breakpoint_param deleted_skill embedding embedding_create_params
    embedding_model eval_create_params eval_create_response eval_custom_data_source_config
    eval_delete_response eval_list_params eval_list_response eval_retrieve_response
    eval_stored_completions_data_source_config eval_update_params eval_update_response
    file_chunking_strategy file_chunking_strategy_param file_content file_create_params
    file_deleted file_list_params file_object file_purpose image image_create_variation_params
    image_edit_completed_event image_edit_params image_edit_partial_image_event
    image_edit_stream_event image_gen_completed_event image_gen_partial_image_event
    image_gen_stream_event image_generate_params image_input_reference_param image_model
    images_response model model_deleted moderation moderation_create_params
    moderation_create_response moderation_image_url_input_param moderation_model
    moderation_multi_modal_input_param moderation_text_input_param
    other_file_chunking_strategy_object skill skill_create_params skill_list skill_list_params
    skill_update_params static_file_chunking_strategy static_file_chunking_strategy_object
    static_file_chunking_strategy_object_param static_file_chunking_strategy_param upload
    upload_complete_params upload_create_params vector_store vector_store_create_params
    vector_store_deleted vector_store_list_params vector_store_search_params
    vector_store_search_response vector_store_update_params video video_create_character_params
    video_create_character_response video_create_error video_create_params
    video_delete_response video_download_content_params video_edit_params video_extend_params
    video_get_character_response video_list_params video_model video_model_param
    video_remix_params video_seconds video_size websocket_connection_options
    websocket_reconnection
deps/openai/types/chat: __init__ chat_completion chat_completion_allowed_tool_choice_param
    chat_completion_allowed_tools_param chat_completion_assistant_message_param
    chat_completion_audio chat_completion_audio_param chat_completion_chunk
    chat_completion_content_part_image chat_completion_content_part_image_param
    chat_completion_content_part_input_audio_param chat_completion_content_part_param
    chat_completion_content_part_refusal_param chat_completion_content_part_text
    chat_completion_content_part_text_param chat_completion_custom_tool_param
    chat_completion_deleted chat_completion_developer_message_param
    chat_completion_function_call_option_param chat_completion_function_message_param
    chat_completion_function_tool chat_completion_function_tool_param
    chat_completion_message chat_completion_message_custom_tool_call
    chat_completion_message_custom_tool_call_param
    chat_completion_message_function_tool_call
    chat_completion_message_function_tool_call_param chat_completion_message_param
    chat_completion_message_tool_call chat_completion_message_tool_call_param
    chat_completion_message_tool_call_union_param chat_completion_modality
    chat_completion_named_tool_choice_custom_param chat_completion_named_tool_choice_param
    chat_completion_prediction_content_param chat_completion_reasoning_effort
    chat_completion_role chat_completion_store_message
    chat_completion_stream_options_param chat_completion_system_message_param
    chat_completion_token_logprob chat_completion_tool_choice_option_param
    chat_completion_tool_message_param chat_completion_tool_param
    chat_completion_tool_union_param chat_completion_user_message_param
    completion_create_params completion_list_params completion_update_params
    create_chat_completion_request_message_param parsed_chat_completion
    parsed_function_tool_call
deps/openai/types/graders/**/*.py
deps/openai/types/responses/**/*.py
deps/openai/types/shared/**/*.py
deps/openai/types/shared_params/**/*.py
deps/openai_harmony: __init__ openai_harmony.*.so
deps/orjson: __init__ orjson.*.so
deps/packaging: __init__ _elffile _manylinux _musllinux _parser _ranges _tokenizer markers requirements
    specifiers tags utils version
deps/packaging/licenses/**/*.py
deps/partial_json_parser: __init__
deps/partial_json_parser/core/**/*.py
deps/prometheus_client: __init__ asgi context_managers decorator exposition gc_collector metrics metrics_core
    mmap_dict platform_collector process_collector registry samples utils validation
    values
deps/prometheus_client/openmetrics: __init__ exposition
deps/psutil: __init__ _common _ntuples _pslinux _psposix _psutil_linux.*.so
deps/pybase64: __init__ _license _pybase64.*.so _version
deps/pydantic: __init__ _migration aliases annotated_handlers config dataclasses errors fields
    functional_serializers functional_validators json_schema main type_adapter types version
    warnings
deps/pydantic/_internal: __init__ _config _contextlib _core_metadata _core_utils _dataclasses _decorators
    _discriminated_union _docs_extraction _fields _forward_ref _generate_schema _generics
    _import_utils _known_annotated_metadata _mock_val_ser _model_construction
    _namespace_utils _repr _schema_gather _schema_generation_shared _serializers
    _signature _type_refs _typing_extra _utils _validators
deps/pydantic/plugin/**/*.py
deps/pydantic_core: __init__ _pydantic_core.*.so core_schema
deps/regex: __init__ _main _regex.*.so _regex_core
deps/requests: __init__ __version__ _internal_utils _types adapters api auth certs compat cookies exceptions
    hooks models packages sessions status_codes structures utils
deps/safetensors: __init__ _safetensors_rust.*.so torch
deps/sniffio: __init__ _impl _version
deps/spmd_types: __init__ _backward_hooks _collectives _dist _dtensor _dtensor_checker _dtype_utils _frame
    _local _mesh _mesh_axis _raw_dist _reinterpret_mesh _scalar _scalar_sentinel _state
    _traceback _type_attr checker runtime types
deps/spmd_types/_checker/**/*.py
deps/tokenizers: __init__ tokenizers.*.so
deps/tokenizers/decoders/**/*.py
deps/tokenizers/implementations/**/*.py
deps/tokenizers/models/**/*.py
deps/tokenizers/normalizers/**/*.py
deps/tokenizers/pre_tokenizers/**/*.py
deps/tokenizers/processors/**/*.py
deps/tokenizers/trainers/**/*.py
deps/transformers: __init__ _typing activations audio_utils cache_utils configuration_utils conversion_mapping
    convert_slow_tokenizer core_model_loading dependency_versions_check
    dependency_versions_table dynamic_module_utils feature_extraction_utils
    image_processing_backends image_processing_base image_processing_utils image_transforms
    image_utils initialization masking_utils modeling_flash_attention_utils
    modeling_gguf_pytorch_utils modeling_layers modeling_outputs modeling_rope_utils
    modeling_utils monkey_patching processing_utils pytorch_utils safetensors_conversion
    tokenization_python tokenization_utils_base tokenization_utils_sentencepiece
    tokenization_utils_tokenizers video_processing_utils video_utils
deps/transformers/distributed/**/*.py
deps/transformers/generation: __init__ candidate_generator configuration_utils logits_process
    stopping_criteria utils
deps/transformers/generation/continuous_batching/**/*.py
deps/transformers/integrations: __init__ accelerate aqlm compressed_tensors deepgemm deepspeed eager_paged
    finegrained_fp8 flash_attention flex_attention fsdp ggml hqq hub_kernels moe
    npu_flash_attention peft sdpa_attention sonicmoe spqr
deps/transformers/integrations/gguf: __init__ dequant gguf_conversion_mapping gguf_tokenizer_mapping kernels
    reader utils
deps/transformers/integrations/heterogeneity/**/*.py
deps/transformers/integrations/mistral: __init__ constants
deps/transformers/loss/**/*.py
deps/transformers/models: __init__
deps/transformers/models/auto/**/*.py
deps/transformers/models/deepseek_v3: __init__ configuration_deepseek_v3
deps/transformers/models/encoder_decoder: __init__ configuration_encoder_decoder
deps/transformers/models/falcon_mamba: __init__ configuration_falcon_mamba
deps/transformers/models/gemma: __init__ tokenization_gemma
deps/transformers/models/gemma4: __init__ configuration_gemma4
deps/transformers/models/glm_ocr: __init__ configuration_glm_ocr
deps/transformers/models/gpt2: __init__ tokenization_gpt2
deps/transformers/models/gpt_oss: __init__ configuration_gpt_oss
deps/transformers/models/lfm2: __init__ configuration_lfm2
deps/transformers/models/lfm2_moe: __init__ configuration_lfm2_moe
deps/transformers/models/lfm2_vl: __init__ configuration_lfm2_vl
deps/transformers/models/llama/**/*.py
deps/transformers/models/mamba: __init__ configuration_mamba
deps/transformers/models/mamba2: __init__ configuration_mamba2
deps/transformers/models/mellum: __init__ configuration_mellum
deps/transformers/models/qwen2: __init__ configuration_qwen2 tokenization_qwen2
deps/transformers/models/qwen2_5_vl: __init__ processing_qwen2_5_vl
deps/transformers/models/qwen3: __init__ configuration_qwen3
deps/transformers/models/qwen3_5: __init__ tokenization_qwen3_5
deps/transformers/models/qwen3_moe: __init__ configuration_qwen3_moe
deps/transformers/models/siglip: __init__ configuration_siglip
deps/transformers/models/t5: __init__ tokenization_t5
deps/transformers/models/whisper: __init__ configuration_whisper english_normalizer tokenization_whisper
deps/transformers/quantizers/**/*.py
deps/transformers/utils: __init__ auto_docstring chat_template_utils constants deprecation doc
    dummy_mistral_common_objects dummy_sentencepiece_and_tokenizers_objects
    dummy_torchvision_objects generic hub import_utils kernel_config loading_report
    logging output_capturing peft_utils quantization_config type_validators versions
deps/transformers/utils/chat_parsing/**/*.py
deps/tvm_ffi: __init__ _convert _dtype _dunder _ffi_api _optional_torch_c_dlpack _tensor _version access_path
    container core.*.so error libinfo module registry serialization stream structural
deps/tvm_ffi/cpp: __init__ dtype extension
deps/tvm_ffi/dataclasses/**/*.py
deps/tvm_ffi/utils: __init__ kwargs_wrapper lockfile unpack_dataclass
deps/typing_inspection: __init__ introspection typing_objects
deps/tyro: __init__ _arguments _calling _cli _docstrings _errors _fields _fmtlib _parsers _resolver _settings
    _singleton _strings _subcommand_matching _typing_compat _unsafe_cache _warnings
deps/tyro/_backends: __init__ _argparse
deps/tyro/conf/**/*.py
deps/tyro/constructors: __init__ _backtracking _primitive_spec _registry _struct_spec
deps/urllib3: __init__ _base_connection _collections _request_methods _version connection connectionpool
    exceptions fields filepost poolmanager response
deps/urllib3/contrib: __init__
deps/urllib3/http2: __init__ probe
deps/urllib3/util/**/*.py
deps/yaml: __init__ _yaml.*.so composer constructor cyaml dumper emitter error events loader nodes parser
    reader representer resolver scanner serializer tokens
deps/zmq: __init__ _future _typing asyncio constants error
deps/zmq/auth: __init__ base certs thread
deps/zmq/backend: __init__ select
deps/zmq/backend/cython: __init__ _zmq.*.so
deps/zmq/sugar/**/*.py
deps/zmq/utils: __init__ interop jsonapi z85
megatron/core: __init__ _rank_utils _slurm_utils config config_logger enums fp4_utils fp8_utils
    full_cuda_graph hyper_comm_grid inference_params jit model_parallel_config msc_utils
    nccl_allocator num_microbatches_calculator optimizer_param_scheduler package_info
    packed_seq_params parallel_state process_groups_config rerun_state_machine safe_globals timers
    typed_torch utils
megatron/core/dist_checkpointing: __init__ core dict_utils mapping optimizer serialization state_dict_utils
    utils validation
megatron/core/dist_checkpointing/strategies: __init__ async_utils checkpointable common nvrx torch
megatron/core/distributed: __init__ data_parallel_base distributed_data_parallel
    distributed_data_parallel_config finalize_model_grads param_and_grad_buffer
    reduce_scatter_with_fp32_accumulation torch_fully_sharded_data_parallel
    torch_fully_sharded_data_parallel_config
megatron/core/distributed/fsdp: __init__ mcore_fsdp_adapter
megatron/core/distributed/fsdp/src: __init__
megatron/core/distributed/fsdp/src/megatron_fsdp: __init__ distributed_data_parallel_config fully_shard
    megatron_fsdp mixed_precision package_info
    param_and_grad_buffer uneven_dtensor utils
megatron/core/extensions: __init__ transformer_engine
megatron/core/fusions: __init__ fused_bias_geglu fused_bias_gelu fused_bias_swiglu fused_indices_converter
    fused_pad_routing_map
megatron/core/inference: __init__ batch_dimensions_utils config inference_request sampling_params
    symmetric_memory unified_memory utils
megatron/core/inference/communication/torch_symm_triton/**/*.py
megatron/core/inference/contexts: __init__ base_context dynamic_context fused_kv_append_kernel gpu_view
    kv_block_allocator mamba_slot_allocator routing_metadata static_context
megatron/core/inference/contexts/attention_context: mamba_metadata metadata_base mha_metadata
megatron/core/inference/moe/**/*.py
megatron/core/inference/quantization/**/*.py
megatron/core/inference/sampling/**/*.py
megatron/core/models: __init__
megatron/core/models/common: __init__
megatron/core/models/common/embeddings: __init__ language_model_embedding rope_utils rotary_pos_embedding
    yarn_rotary_pos_embedding
megatron/core/models/hybrid: __init__ hybrid_layer_allocation
megatron/core/optimizer: __init__ clip_grads distrib_optimizer emerging_optimizers grad_scaler
    layer_wise_optimizer optimizer optimizer_config param_layout
megatron/core/optimizer/cpu_offloading/**/*.py
megatron/core/pipeline_parallel/**/*.py
megatron/core/quantization/**/*.py
megatron/core/ssm: __init__ mamba_layer
megatron/core/tensor_parallel/**/*.py
megatron/core/tokenizers: __init__ base_tokenizer megatron_tokenizer
megatron/core/transformer: __init__ cuda_graph_config cuda_graphs enums fsdp_dtensor_checkpoint identity_op
    mlp module pipeline_parallel_layer_layout spec_utils torch_norm transformer_config
    transformer_layer utils
megatron/core/transformer/moe: __init__ fused_a2a inference_routing_mask_kernel moe_logging moe_utils
    paged_stash router router_replay shared_experts token_dispatcher
    token_dispatcher_inference
megatron/core/transformer/moe/ops/**/*.py
sglang: __init__ _version utils version
sglang/kernels: __init__ fused_op kernel_api_logging registry selector spec
sglang/kernels/jit: __init__
sglang/kernels/jit/utils: __init__ arch common deps
sglang/kernels/jit/utils/compile/**/*.py
sglang/kernels/ops: __init__
sglang/kernels/ops/activation: __init__ silu_and_mul_clamp
sglang/kernels/ops/attention: __init__ clamp_position dcp_kernels kv_indices position
sglang/kernels/ops/communication: __init__ all_reduce
sglang/kernels/ops/diffusion: __init__
sglang/kernels/ops/elementwise: __init__
sglang/kernels/ops/embeddings: __init__
sglang/kernels/ops/gemm: __init__ fp8_kernel int8_kernel
sglang/kernels/ops/grammar: __init__
sglang/kernels/ops/kv_canary: __init__ scatter_req_token_ids
sglang/kernels/ops/kvcache: __init__ cache_move cache_ops dsa_index_k_cache kvcache mla_buffer
sglang/kernels/ops/layernorm: __init__
sglang/kernels/ops/lora: __init__
sglang/kernels/ops/lplb: __init__
sglang/kernels/ops/mamba: __init__
sglang/kernels/ops/memory: __init__ allocator memcpy_triton
sglang/kernels/ops/mm: __init__
sglang/kernels/ops/moe: __init__ dsv4 fill_padded_rows fused_moe_triton_kernels triton_pad_expert_counts
sglang/kernels/ops/quantization: __init__ awq_triton dsa_quant_k_cache fp8_kernel fp8_utils gptq_marlin_repack
    int8_kernel per_token_group_quant
sglang/kernels/ops/sampling: __init__
sglang/kernels/ops/speculative: __init__
sglang/lang: api chat_template choices global_config interpreter ir
sglang/lang/backend: base_backend runtime_endpoint
sglang/srt: constants environ runtime_context server_args
sglang/srt/arg_groups: __init__ arg_utils argparse_actions choices field_order model_override_base overrides
    prefill_buffer_ceiling validation_hook
sglang/srt/arg_groups/fields/**/*.py
sglang/srt/arg_groups/model_overrides/**/*.py
sglang/srt/batch_invariant_ops/**/*.py
sglang/srt/batch_overlap: single_batch_overlap
sglang/srt/compilation: compilation_config
sglang/srt/configs: __init__ afmoe bailing_hybrid bailing_moe_v2 beam chatglm cohere2_moe cosmos3 dbrx
    deepseek_ocr deepseek_v41 deepseekvl2 dots3 dots_ocr dots_vlm embedding_model_spec exaone
    falcon_h1 gigachat35 glm5_next granitemoehybrid hy_v4 hybrid_arch inkling interns2_mobius
    interns2preview internvl iquest_q1 janus_pro jet_nemotron jet_vlm k2_horizon kimi_k25
    kimi_k3 kimi_linear kimi_vl kimi_vl_moonvit laguna lfm2 lfm2_moe lfm2_vl
    linear_attn_model_registry locate_anything longcat_flash mamba mamba2 mamba_utils minicpm
    minicpmv4_6 minicpmv4_7 minimax_vl model_config model_config_parser_registry muse_glimmer
    muse_glimmer_processing muse_spark nanbeige nano_nemotron_vl nemotron_h olmo3 qwen3_5
    qwen3_asr qwen3_next qwen3_omni qwen3_vl qwen4_exp radio shared_experts spark2_5 step3_vl
    step3p5 step3p7 unlimited_ocr update_config utils zaya
sglang/srt/connector: __init__ base_connector redis remote_instance s3 utils
sglang/srt/connector/serde/**/*.py
sglang/srt/disaggregation: utils
sglang/srt/disaggregation/base/**/*.py
sglang/srt/distributed: __init__ communication_op communication_tags naive_distributed parallel_state utils
sglang/srt/distributed/device_communicators: cuda_wrapper custom_all_reduce_utils custom_all_reduce_v2
    mooncake_transfer_engine pynccl_allocator
sglang/srt/distributed/device_communicators/configs/**/*.py
sglang/srt/elastic_ep: elastic_ep topology
sglang/srt/eplb: __init__ expert_distribution expert_location expert_location_dispatch
sglang/srt/hardware_backend/cpu/quantization/**/*.py
sglang/srt/hardware_backend/gpu/quantization: gptq_kernels
sglang/srt/hardware_backend/mlx: runtime
sglang/srt/hardware_backend/mps/**/*.py
sglang/srt/hardware_backend/npu: utils
sglang/srt/hardware_backend/npu/moe: activation finalize_routing init_routing matmul quant
sglang/srt/hardware_backend/npu/quantization: linear_method_npu moe_methods
sglang/srt/kv_canary: __init__ req_to_expected_token_ids_manager
sglang/srt/layers: amx_utils dp_attention int4fp8_utils layernorm_sp linear modelopt_utils parameter
    radix_attention
sglang/srt/layers/attention: graph_utils mqa_logits_utils
sglang/srt/layers/attention/dsa: utils
sglang/srt/layers/dcp: __init__ comm layout metadata
sglang/srt/layers/deep_gemm_wrapper/**/*.py
sglang/srt/layers/moe: __init__ flashinfer_trtllm_moe topk utils
sglang/srt/layers/moe/moe_runner: __init__ ascend base deep_gemm deep_gemm_sm120 flashinfer_trtllm marlin
    runner triton triton_kernels
sglang/srt/layers/moe/moe_runner/triton_utils/**/*.py
sglang/srt/layers/moe/token_dispatcher/**/*.py
sglang/srt/layers/quantization: __init__ auto_round base_config base_scheme bitsandbytes blockwise_int8
    dequantization fp4_kv_cache_quant_method fp4_utils fp8 fp8_utils gguf humming
    int8_utils kv_cache kvfp4_tensor marlin_utils marlin_utils_fp4
    marlin_utils_fp8 minimax_m3_nvfp4 mlx modelopt_quant moe_wna16 mxfp4
    mxfp4_tensor mxfp8_input npu_mxfp4 npu_mxfp4_w4a4 nvfp4_online
    online_quantization petit petit_utils quark_int4fp8_moe unquant utils w4afp8
    w8a8_fp8 w8a8_int8
sglang/srt/layers/quantization/awq/**/*.py
sglang/srt/layers/quantization/compressed_tensors/**/*.py
sglang/srt/layers/quantization/gptq/**/*.py
sglang/srt/layers/quantization/modelslim/**/*.py
sglang/srt/layers/quantization/quark: __init__ quark utils
sglang/srt/layers/quantization/quark/schemes/**/*.py
sglang/srt/layers/utils: __init__ common
sglang/srt/lora: lora_registry
sglang/srt/lora/marlin_lora_temp: __init__ sgl_backend
sglang/srt/mem_cache: allocation_sizing evict_policy hicache_storage host_memory index_key_cache
    kv_vmm_backing memory_pool utils
sglang/srt/mem_cache/allocator: __init__ base mamba paged token
sglang/srt/mem_cache/cpp_utils/**/*.py
sglang/srt/mem_cache/layout: __init__ token_major
sglang/srt/mem_cache/pool_host: __init__ base common group
sglang/srt/mem_cache/storage: __init__ backend_factory
sglang/srt/mem_cache/storage/mmap/**/*.py
sglang/srt/model_executor: cuda_graph_config forward_batch_deepseek_mha_mixin forward_batch_info
    forward_context
sglang/srt/model_executor/runner_backend_utils: __init__
sglang/srt/model_executor/runner_backend_utils/breakable_cuda_graph/**/*.py
sglang/srt/model_executor/runner_backend_utils/tc_piecewise_cuda_graph/**/*.py
sglang/srt/model_executor/runner_utils: __init__ forward_batch prefill_graph
sglang/srt/multimodal: __init__ customized_mm_processor_utils internvl_utils mm_utils
sglang/srt/observability: func_timer metrics_collector scheduler_stage_metrics utils
sglang/srt/platforms/**/*.py
sglang/srt/plugins/**/*.py
sglang/srt/sampling: custom_logit_processor
sglang/srt/sampling/watermarking: __init__ config detector
sglang/srt/speculative: decoupled_spec_io spec_info spec_registry
sglang/srt/state_capturer: __init__ base routed_experts
sglang/srt/utils: __init__ aio_rwlock async_probe common cuda_vmm_utils custom_op gauge_histogram
    hf_transformers_patches hf_transformers_utils host_shared_memory msgspec_utils network
    nvtx_utils offloader patch_tokenizer patch_torch runai_utils stale_shm_cleanup
    torch_memory_saver_adapter video_decoder
sglang/srt/utils/hf_transformers/**/*.py
torchtitan: __init__
torchtitan/config/**/*.py
torchtitan/distributed: __init__ compile parallel_dims spmd_types utils
torchtitan/distributed/deepep/**/*.py
torchtitan/distributed/minimal_async_ep/**/*.py
torchtitan/models: __init__
torchtitan/models/common: __init__ attention decoder embedding feed_forward linear moe nn_modules rope
    token_dispatcher
torchtitan/observability: __init__
torchtitan/observability/structured_logger: __init__ step_state structured_logging
torchtitan/ops/**/*.py
torchtitan/protocols/**/*.py
torchtitan/tools: logging utils
vllm: __init__ _aiter_ops _custom_ops _version connections env_override envs exceptions forward_context logger
    logprobs outputs pooling_params sampling_params scalar_type sequence tasks version
vllm/assets: __init__ base
vllm/compilation: __init__ breakable_cudagraph counter cuda_graph cudagraph_pool monitor
vllm/compilation/passes: __init__ inductor_pass
vllm/config/**/*.py
vllm/device_allocator: __init__
vllm/distributed: __init__ communication_op nixl_utils parallel_state stateless_coordinator utils
vllm/distributed/device_communicators: __init__ aiter_custom_all_reduce all2all all_reduce_utils
    base_device_communicator cuda_communicator cuda_wrapper pynccl
    pynccl_allocator pynccl_wrapper shm_broadcast shm_object_storage
vllm/distributed/ec_transfer: __init__ ec_transfer_state
vllm/distributed/ec_transfer/ec_connector: __init__ base factory utils
vllm/distributed/eplb/**/*.py
vllm/distributed/kv_transfer: __init__ kv_transfer_state
vllm/distributed/kv_transfer/kv_connector: __init__ base factory utils
vllm/distributed/kv_transfer/kv_connector/v1: __init__ base decode_bench_connector
vllm/entrypoints: __init__
vllm/entrypoints/generate: __init__
vllm/entrypoints/generate/base: __init__ protocol
vllm/entrypoints/mcp/**/*.py
vllm/entrypoints/openai: __init__
vllm/entrypoints/openai/chat_completion: __init__ protocol
vllm/entrypoints/openai/parser/**/*.py
vllm/entrypoints/openai/responses: __init__ protocol
vllm/entrypoints/serve: __init__
vllm/entrypoints/serve/engine: __init__ protocol
vllm/entrypoints/serve/exception_handling: __init__ error_response utils
vllm/inputs/**/*.py
vllm/ir/**/*.py
vllm/kernels: __init__ aiter_ops oink_ops vllm_c
vllm/kernels/triton/**/*.py
vllm/logging_utils: __init__ formatter lazy log_time torch_tensor uvicorn_logging
vllm/lora: __init__ request
vllm/model_executor: __init__ custom_op parameter utils
vllm/model_executor/determinism/**/*.py
vllm/model_executor/layers: __init__ attention_layer_base linear utils vocab_parallel_embedding
vllm/model_executor/layers/attention: __init__ attention chunked_local_attention cross_attention
    encoder_only_attention kv_transfer_utils mla_attention
    mm_encoder_attention prefill_prefix_lm_attention rswa_attention
    static_sink_attention
vllm/model_executor/layers/fused_moe: __init__ activation all2all_utils config expert_map_manager
    expert_substitution fused_moe fused_moe_method_base layer modular_kernel
    moe_align_block_size moe_output routed_experts routed_experts_capturer
    topk_weight_and_reduce unquantized_fused_moe_method utils
vllm/model_executor/layers/fused_moe/experts: __init__ rocm_aiter_moe
vllm/model_executor/layers/fused_moe/oracle: __init__ base unquantized
vllm/model_executor/layers/fused_moe/prepare_finalize: __init__ batched deepep_ll deepep_v2 flashinfer_nvlink_one_sided
    flashinfer_nvlink_two_sided naive_dp_ep no_dp_ep
    passthrough
vllm/model_executor/layers/fused_moe/router: __init__ aiter_shared_routed_fused_moe_router base_router
    cpu_router custom_routing_router dsv4_topk fused_moe_router
    fused_topk_bias_router fused_topk_router gate_linear
    grouped_topk_router router_factory routing_simulator_router
    zero_expert_router
vllm/model_executor/layers/fused_moe/runner/**/*.py
vllm/model_executor/layers/fusion: __init__ quant_activation
vllm/model_executor/layers/quantization: __init__ base_config input_quant_fp8 kv_cache torchao
vllm/model_executor/layers/quantization/utils: __init__ config_utils flashinfer_utils fp8_utils int8_utils
    layer_utils mxfp4_utils mxfp6_utils mxfp8_utils
    nvfp4_emulation_utils ocp_mx_utils quant_utils w8a8_utils
vllm/model_executor/model_loader: __init__ base_loader default_loader dummy_loader ep_weight_filter
    modelexpress_loader runai_streamer_loader sharded_state_loader tensorizer
    tensorizer_loader utils weight_tying weight_utils
vllm/model_executor/model_loader/reload: __init__ layerwise meta sanitize torchao_decorator types utils
vllm/model_executor/model_loader/weight_cache: __init__ ipc_loader protocol utils
vllm/model_executor/models: __init__ interfaces interfaces_base registry utils vision
vllm/model_executor/offloader/**/*.py
vllm/model_executor/warmup: __init__ jit_warmup jit_warmup_triton_helper
vllm/multimodal: __init__ audio gpu_ipc_memory hasher image inputs parse registry utils video
vllm/multimodal/cache/**/*.py
vllm/multimodal/media/**/*.py
vllm/multimodal/processing/**/*.py
vllm/multimodal/video_decoders: __init__ base
vllm/parser: __init__ abstract_parser harmony metrics parser_manager utils
vllm/parser/engine: __init__ adapters events parser_engine_config
vllm/platforms: __init__ interface
vllm/plugins: __init__
vllm/ray: __init__ lazy_utils
vllm/reasoning: __init__ abs_reasoning_parsers gptoss_reasoning_parser
vllm/renderers: __init__ base embed_utils params registry
vllm/renderers/chat_utils/**/*.py
vllm/renderers/inputs/**/*.py
vllm/third_party: __init__ pynvml
vllm/third_party/triton_kernels: __init__ matmul_ogs numerics routing specialize target_info tensor
vllm/third_party/triton_kernels/matmul_ogs_details/**/*.py
vllm/third_party/triton_kernels/numerics_details/**/*.py
vllm/third_party/triton_kernels/reduction_details/**/*.py
vllm/third_party/triton_kernels/routing_details/**/*.py
vllm/third_party/triton_kernels/tensor_details/**/*.py
vllm/tokenizers: __init__ hf protocol registry
vllm/tool_parsers: __init__ abstract_tool_parser gptoss_tool_parser streaming structural_tag_registry
    tool_strict_level utils
vllm/tracing/**/*.py
vllm/transformers_utils: __init__ config config_parser_base deepseek_v4_utils dynamic_module
    model_arch_config_convertor processor repo_utils runai_utils s3_utils utils
vllm/transformers_utils/processors: __init__
vllm/triton_utils: __init__ allocation importing tensor_descriptor
vllm/usage/**/*.py
vllm/utils: __init__ argparse_utils async_utils cache collection_utils counter cpu_resource_utils deep_gemm
    flashinfer func_utils gpu_sync_debug hashing import_utils jsontree math_utils mem_constants
    mem_utils mistral nccl network_utils platform_utils registry serial_utils sparse_utils
    system_utils torch_utils torch_version
vllm/v1: __init__ kv_cache_interface kv_cache_layout kv_cache_spec_registry outputs request serial_utils utils
vllm/v1/attention: __init__ backend selector
vllm/v1/attention/backends: __init__ fa_utils registry utils
vllm/v1/attention/backends/mla: __init__ compressor_utils index_group indexer sparse_utils
vllm/v1/attention/backends/mla/prefill: __init__ base registry selector
vllm/v1/attention/ops: __init__ common cp_common dcp merge_attn_states pcp rocm_aiter_mla_sparse
    triton_reshape_and_cache_flash vit_attn_wrappers
vllm/v1/core: __init__ kv_cache_utils
vllm/v1/core/sched: __init__ output
vllm/v1/engine: __init__
vllm/v1/executor: __init__ abstract uniproc_executor vllm_net_devices
vllm/v1/hisparse: __init__ runtime types
vllm/v1/kv_hints/**/*.py
vllm/v1/kv_offload: __init__
vllm/v1/kv_offload/cpu: __init__ host_register shared_offload_region
vllm/v1/metrics: __init__ cache_hit_source perf stats utils
vllm/v1/simple_kv_offload: __init__ cuda_mem_ops
vllm/v1/spec_decode: __init__ metrics
vllm/v1/structured_output: __init__ backend_guidance backend_types backend_xgrammar request utils
vllm/v1/worker: __init__ block_table dp_utils ubatch_utils ubatching worker_base workspace
deps/tvm_ffi/lib/**
sglang/kernels/jit/csrc/**
sglang/kernels/jit/include/**
"""


def parse_keep(text: str) -> tuple[dict[str, list[str]], list[str]]:
    """KEEP's lines as {DIR: [name globs]} and the list of other patterns."""
    names: dict[str, list[str]] = {}
    patterns: list[str] = []
    folder = ""
    for line in text.split("\n"):
        if ": " in line or line.startswith(" "):
            if ": " in line:
                folder, line = line.split(": ", 1)
            names.setdefault(folder, []).extend(n if "." in n else n + ".py" for n in line.split())
        elif line.strip():
            patterns.append(line.strip())
    return names, patterns


def kept(path: str, names: dict[str, list[str]], patterns: list[str]) -> bool:
    """Whether `path` (relative to the folder) is one KEEP names."""
    folder, _, name = path.rpartition("/")
    if any(fnmatch.fnmatchcase(name, n) for n in names.get(folder, ())):
        return True
    for pattern in patterns:
        base, _, tail = pattern.partition("/**")
        if path.startswith(base + "/") and (tail == "" or (tail == "/*.py" and path.endswith(".py"))):
            return True
    return False


def download(requirements: tuple[str, ...], python_version: str, dest: Path, any_python: bool) -> None:
    """pip download the wheels (no dependencies, binaries only) for `python_version` into dest."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "-d", str(dest), *requirements]
    if any_python:
        command.insert(4, "--ignore-requires-python")
    subprocess.run(command, check=True)


def unpack(wheel: Path, out: Path, names: dict[str, list[str]], patterns: list[str]) -> list[Path]:
    """The files of `wheel` to keep, unpacked under out (a framework) or out/deps; returns them."""
    framework = wheel.name.split("-")[0].lower() in FRAMEWORKS
    prefix = "" if framework else "deps/"
    written = []
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if not m.endswith("/")]
        keep = {m for m in members if kept(prefix + m, names, patterns)
                or m.split("/")[0].endswith(".libs")  # libraries vendored for its compiled modules
                or (m.split("/")[0].endswith(".dist-info") and m.count("/") == 1
                    and m.rsplit("/", 1)[1] in ("METADATA", "entry_points.txt"))}
        # the __init__.py of every package above a kept file
        for member in list(keep):
            parts = PurePosixPath(member).parts
            for depth in range(1, len(parts)):
                init = "/".join(parts[:depth]) + "/__init__.py"
                if init in members:
                    keep.add(init)
        for member in sorted(keep):
            path = Path(archive.extract(member, out / prefix if prefix else out))
            if path.name == "METADATA":  # its headers (what importlib.metadata reads), not the long description
                path.write_bytes(path.read_bytes().split(b"\n\n", 1)[0] + b"\n")
            written.append(path)
    return written


def strip(files: list[Path]) -> None:
    """Symbol tables off the shared objects (they load the same), when `strip` is on PATH."""
    tool = shutil.which("strip")
    if tool is None:
        return
    for path in files:
        if ".so" in path.suffixes or path.suffix == ".so":
            subprocess.run([tool, "--strip-unneeded", str(path)], check=False, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="the Python that will read the folder (compiled dependencies are fetched for it); "
                             "default: this interpreter's")
    parser.add_argument("--out", type=Path, default=ROOT / ".frameworks",
                        help="the folder to fill (replaced when it exists); default: <repo>/.frameworks")
    parser.add_argument("--training-only", action="store_true",
                        help="Megatron-Core and torchtitan alone (no vLLM, SGLang)")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="keep the downloaded wheels in this folder (reused when there); default: a temporary one")
    parser.add_argument("--leave-out", nargs="+", default=[], metavar="DIST",
                        help="dependencies not to fetch: the target Python has them (at the versions pinned here)")
    parser.add_argument("--no-strip", action="store_true", help="leave shared objects as they are")
    args = parser.parse_args(argv)

    names, patterns = parse_keep(KEEP)
    frameworks = TRAINING + (() if args.training_only else SERVING)
    left_out = {name.replace("_", "-").lower() for name in args.leave_out}
    deps = tuple(r for r in TRAINING_DEPS + (() if args.training_only else SERVING_DEPS)
                 if r.split("==")[0].replace("_", "-").lower() not in left_out)
    out = args.out.resolve()
    with tempfile.TemporaryDirectory(prefix="moe_ep-frameworks-") as scratch:
        wheels = args.wheels.resolve() if args.wheels else Path(scratch) / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        try:
            download(frameworks, args.python_version, wheels, any_python=True)
            download(deps, args.python_version, wheels, any_python=False)
        except subprocess.CalledProcessError as error:
            print(f"fetch_frameworks: pip could not give the wheels ({error})", file=sys.stderr)
            return 1
        wanted = {r.split("==")[0].replace("-", "_").lower() + "-" + r.split("==")[1] for r in frameworks + deps}
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            files: list[Path] = []
            for wheel in sorted(wheels.glob("*.whl")):
                if "-".join(wheel.name.split("-")[:2]).lower() in wanted:
                    files += unpack(wheel, staging, names, patterns)
            if not args.no_strip:
                strip(files)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    print(f"fetch_frameworks: {len(files)} files of {len(wanted)} wheels for Python {args.python_version} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
