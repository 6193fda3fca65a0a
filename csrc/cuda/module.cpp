// Python module stub of hybridrl._C_cuda: importing it runs the static TORCH_LIBRARY_IMPL
// registrations of the CUDA kernels in csrc/cuda/*.cu (schemas come from hybridrl._C).
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C_cuda(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
