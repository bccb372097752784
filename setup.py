"""Builds moe_ep. With nvcc present it compiles moe_ep.comm._C from csrc/ (nvcc + ninja + pybind11 against
the NVSHMEM wheel, no libtorch) and pins that exact NVSHMEM wheel as a runtime requirement, and, where CUTLASS's
headers are found (the nvidia-cutlass wheel, or $MOE_EP_CUTLASS_DIR), moe_ep.moe._gemm from csrc/gemm/ (the
sm_90a FP8 grouped GEMM); without nvcc, or with MOE_EP_NATIVE=0 (`--config-settings native=0`), it installs the
pure-Python package, which then runs on the reference backend and the Triton kernels."""
from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "build_backend"))

from moe_ep_build import gemm_build, ninja_build, toolchain  # noqa: E402

CUDA = toolchain.build_cuda()
NVSHMEM = toolchain.find_nvshmem(CUDA.nvshmem_dist) if CUDA else None
CUTLASS = toolchain.find_cutlass() if CUDA else None
BUILD_GEMM = CUDA is not None and toolchain.gemm_skip_reason(CUDA, CUTLASS) is None
BUILD_INFO = "_build_info.json"


class BuildNative(build_ext):
    """Builds moe_ep.comm._C and moe_ep.moe._gemm with ninja (see moe_ep_build.ninja_build and gemm_build)
    instead of setuptools' compilers.

    Objects, the linked modules and stable copies of the build environment's pybind11 and NVSHMEM live
    in build/native-<python tag>/ and build/gemm-<python tag>/ of the source tree, so rebuilds are incremental.
    Every build also leaves the modules and _C's build info in the source package: `python -m pytest` run from the
    checkout imports moe_ep from there, so it tests the modules just built.
    """

    def run(self) -> None:
        super().run()
        if not self.inplace:  # in-place and editable builds have copied already
            self.copy_extensions_to_source()

    def build_extension(self, ext: Extension) -> None:
        output = Path(self.get_ext_fullpath(ext.name)).resolve()
        tag = sysconfig.get_config_var("EXT_SUFFIX").split(".")[1]
        if ext.name == gemm_build.MODULE:
            gemm_build.run(gemm_build.GemmBuild(cuda=CUDA, cutlass=CUTLASS, csrc=ROOT / "csrc",
                                                build_dir=ROOT / "build" / f"gemm-{tag}", output=output))
            return
        if NVSHMEM is None:
            raise RuntimeError(f"nvcc ({CUDA.nvcc}, CUDA {CUDA.version[0]}.{CUDA.version[1]}) was found but "
                               f"{CUDA.nvshmem_dist} is not installed: pip install {CUDA.nvshmem_dist}")
        build = ninja_build.NativeBuild(cuda=CUDA, nvshmem=NVSHMEM, archs=toolchain.cuda_archs(),
                                        csrc=ROOT / "csrc", build_dir=ROOT / "build" / f"native-{tag}",
                                        output=output)
        ninja_build.run(build)
        ninja_build.write_build_info(build, output.parent / BUILD_INFO)

    def copy_extensions_to_source(self) -> None:
        """The build info goes next to _C in the source package too."""
        super().copy_extensions_to_source()
        package_dir = ROOT / self.get_finalized_command("build_py").get_package_dir("moe_ep.comm")
        shutil.copyfile(Path(self.build_lib) / "moe_ep" / "comm" / BUILD_INFO, package_dir / BUILD_INFO)


# matplotlib: `python -m moe_ep.bench` writes a PNG plot.
install_requires = ["torch", "numpy", "tqdm", "matplotlib"]
if NVSHMEM is not None:
    install_requires.append(f"{NVSHMEM.dist}=={NVSHMEM.dist_version}")

setup(
    install_requires=install_requires,
    ext_modules=([Extension("moe_ep.comm._C", sources=[])] if CUDA else [])
    + ([Extension(gemm_build.MODULE, sources=[])] if BUILD_GEMM else []),
    cmdclass={"build_ext": BuildNative},
)
