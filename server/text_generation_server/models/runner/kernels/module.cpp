// The Python module of one variant, named after it (TORCH_EXTENSION_NAME is tgi_cpu_kernels_<variant>,
// set by kernel_build.py): pybind11 keeps one module per name in a process, so variants sharing a
// name would all be the first one imported. Its contents come from the bindings (cpu_kernels.cpp).
#include <pybind11/pybind11.h>

void tgi_define_module(pybind11::module_& module);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) { tgi_define_module(module); }
