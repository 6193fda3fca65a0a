// Python module of hybridrl._C_cuda: importing it runs the static TORCH_LIBRARY_IMPL
// registrations of the CUDA kernels in csrc/cuda/*.cu (schemas come from hybridrl._C). It also
// exposes the GAE launch plan, a pure host function (gae_plan.h), so tests can compare the shapes
// the kernel launches with their emulation:
//   gae_plan(B, T, acc_bytes, sms) -> (row_threads, chunk, rows_per_block, blocks)
#include <Python.h>

#include "gae_plan.h"

namespace {

PyObject* py_gae_plan(PyObject*, PyObject* args) {
  long long B = 0, T = 0;
  int acc_bytes = 0, sms = 0;
  if (!PyArg_ParseTuple(args, "LLii", &B, &T, &acc_bytes, &sms)) return nullptr;
  if (B < 0 || T < 0 || (acc_bytes != 4 && acc_bytes != 8) || sms < 1) {
    PyErr_SetString(PyExc_ValueError,
                    "gae_plan: need B >= 0, T >= 0, acc_bytes in (4, 8) and sms >= 1");
    return nullptr;
  }
  const hybridrl::GaePlan plan = hybridrl::plan_gae(B, T, acc_bytes, sms);
  return Py_BuildValue("(iiiL)", plan.row_threads, plan.chunk, plan.rows_per_block,
                       static_cast<long long>(plan.blocks));
}

PyMethodDef kMethods[] = {
    {"gae_plan", py_gae_plan, METH_VARARGS,
     "gae_plan(B, T, acc_bytes, sms) -> (row_threads, chunk, rows_per_block, blocks)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C_cuda(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, kMethods};
  return PyModule_Create(&module);
}
