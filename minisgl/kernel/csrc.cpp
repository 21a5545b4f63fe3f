// Chapter 07 (07_stage1_milestone.ipynb): the fused CPU kernels, in C++.
//
// Each function does in one pass over the data what the torch ops of one layer do in several:
// an RMSNorm is about nine tensor operations (add, pow, mean, rsqrt, mul, ...), each paying the
// dispatcher, an output allocation and a trip through memory; here it is one loop. Every
// function checks its inputs (float32, CPU, rows contiguous in the last dim, consistent shapes,
// slots inside the pool) and raises a clear error instead of touching memory it does not own.
// Rows are spread over the kernels' own threads (split_rows, common.h) only when there are
// enough of them (a prefill); a decode batch runs on the calling thread. `linear` is the
// exception: a decode batch's matmul splits the weight's output features over the threads,
// since reading the weight is the whole cost. The kernels live in the four headers of csrc/
// (one translation unit: one compiler run); the PYBIND11_MODULE block below names what
// Python can call.
#include "csrc/common.h"
#include "csrc/small_ops.h"
#include "csrc/linear.h"
#include "csrc/attention.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rmsnorm", &rmsnorm, "RMSNorm of each row");
  m.def("fused_add_rmsnorm", &fused_add_rmsnorm, "residual += x, then RMSNorm of residual");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up]");
  m.def("rope_inplace", &rope_inplace, "rotate every head of each row (of x, and x2 when "
        "given) by its position", py::arg("positions"), py::arg("x"), py::arg("cos_sin"),
        py::arg("head_size"), py::arg("x2") = py::none());
  m.def("argmax_rows", &argmax_rows, "each row's largest logit's index (torch.argmax's)");
  m.def("decode_attention", &decode_attention, "one query per request over the paged pool");
  m.def("store_kv", &store_kv, "row j of k and v into slot out_loc[j] of one layer's caches");
  m.def("linear", &linear, "x @ w.T (+ bias) for a few rows of x");
  m.def("kv_read_ahead_plan", &kv_read_ahead_plan, "(address, bytes) of the key and value "
        "rows the workers prefetch after w: the rows the attention after w read, at its slots");
  m.def("set_kv_read_ahead", &set_kv_read_ahead, "prefetch the next attention's rows (default "
        "true); the old setting");
  m.def("forget_kv_rows", &forget_kv_rows, "for tests: forget which rows followed which matmul");
  m.def("read_ahead_plan", &read_ahead_plan, "(address, bytes) the workers read ahead after w");
  m.def("set_read_ahead", &set_read_ahead, "bytes read ahead after a call (0: none); the old");
  m.def("weight_buffer", &weight_buffer, "nbytes of zeroed memory on a 2 MB boundary, in 2 MB "
        "pages where the OS has them: the only memory the workers read ahead");
  m.def("set_free_wait", &set_free_wait, "seconds a weight buffer's free waits for a worker "
        "reading ahead in it (then it stays mapped); the old limit");
  m.def("count_readers", &count_readers, "for tests: add delta to the workers counted as "
        "reading ahead; the new count");
  m.def("split_order", &split_order, "[chunks the caller took, chunks the workers took] of a "
        "split of n items, each chunk waiting us microseconds first");
  m.def("prefetch_ahead", &prefetch_ahead, "floats the 2-7-row loop prefetches ahead at this "
        "many rows of x (-1: still tuning)", py::arg("rows"));
  m.def("prefetch_locality", &prefetch_locality, "the hint the 2-7-row loop prefetches with at "
        "this many rows of x (0: prefetchnta, 1: prefetcht2; -1: still tuning)", py::arg("rows"));
  m.def("set_prefetch_ahead", &set_prefetch_ahead, "fix the distance and hint for this many rows "
        "(floats -1: tune again); the old distance", py::arg("rows"), py::arg("floats"),
        py::arg("locality") = 0);
  m.def("last_prefetch", &last_prefetch, "(locality, floats) the 2-7-row loop last prefetched "
        "with ((-1, -1): not run yet)");
  m.def("prefetch_tune_bytes", &prefetch_tune_bytes, "rounds x bytes of the weights with two "
        "rounds that end the tuning");
  m.def("prefetch_tuning", &prefetch_tuning, "(locality, floats, seconds, bytes) timed per "
        "candidate at this many rows", py::arg("rows"));
  m.def("vector_lanes", &vector_lanes, "floats per vector in this build");
  m.def("vector_isa", &vector_isa, "the vector instructions this build targets");
}
