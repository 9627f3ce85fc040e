// The one way commlib launches a kernel (launch_kernel), and the prologue of kernels that may be
// launched with programmatic dependent launch (pdl_begin).
//
// Note [programmatic dependent launch]
// Why: at decode sizes a step of commlib work is a few short kernels back to back (EP dispatch,
// combine; fused all-reduce + RMSNorm), and each kernel boundary costs microseconds of launch,
// CTA placement and prologue. With COMMLIB_PDL=1 (resolved per communicator, passed in the params'
// `order`) the launchers of the EP, fused LL, flat and flat LL kernels set cudaLaunchAttributeProgrammaticStreamSerialization: the kernel may be scheduled
// before the previous kernel of its stream has completed, namely once every CTA of that previous
// ("primary") grid has executed griddepcontrol.launch_dependents or exited (without a trigger:
// when all its CTAs have exited). Stream capture records the dependency as a programmatic edge, so
// CUDA graphs get the same overlap.
// Rules each kernel follows (pdl_begin, first statement of the kernel):
// 1. Wait first. Every thread executes griddepcontrol.wait before its first memory access (the
//    call counter or the EPControl seq, the poisoned word, flags, inputs) and before any early
//    return. PTX: .wait returns when every prerequisite grid has completed and all its memory
//    operations are performed and visible to this grid (programming guide: the primary has
//    completed and flushed its results to global memory). So from there on the kernel sees exactly
//    what it sees under plain stream order, and every protocol argument that relies on "kernels of
//    one communicator run in stream order" (Note [flag barrier]: call_end's count read by the next
//    call_begin; Note [EP GPU protocol]: combine's seq read by the next dispatch) holds unchanged.
//    Waiting before any early return also keeps the order transitive: our grid completes only
//    after its primary completed, so a third grid that waits for ours has waited for the first.
// 2. Trigger right after the wait. griddepcontrol.launch_dependents publishes and orders nothing
//    (the dependent's own .wait does, rule 1), so its position only decides when the dependent's
//    CTAs may take SM slots. Early is the point (the dependent's launch and CTA placement overlap
//    this kernel); after the wait rather than before, so that a stream never has more than two of
//    these grids resident at once (the running one and one waiting), never a chain.
// 3. Residency, the crux: the EP, fused and flat kernels spin on peers' flags and need all their
//    CTAs resident at once (grid <= SMs). The dependent is scheduled only when every CTA of the
//    primary has issued launch_dependents or completed; a CTA that was never placed has done
//    neither. So when any CTA of a dependent takes an SM slot, every CTA of the primary already
//    holds its own slot (or is done): a dependent can never take the slot a primary CTA still
//    needs. The dependent's CTAs sit in griddepcontrol.wait (no flag spin, no timeout clock
//    running) until the primary completes; then the primary's slots are free and the rest of the
//    dependent's CTAs are placed, as they would be without PDL. By induction along the stream
//    every grid gets all its CTAs resident. The same holds after another library's kernel that
//    triggers early: its CTAs are all resident when it does.
//    Cost: CTAs waiting in .wait hold registers and shared memory that kernels of other streams
//    could use meanwhile (e.g. a GEMM beside the fused kernel in the TokenWeave overlap).
// 4. COMMLIB_PDL=0 (default): launched without the attribute, and the kernel skips both
//    instructions (the order is a kernel argument), so not even another library's PDL kernel after
//    ours is launched earlier.
// Kernels launched without the attribute (tree, barrier fused, all_to_all_v, multimem) neither
// wait nor trigger: a PDL kernel after one of them starts when it has exited (implicit trigger) and
// still waits for its completion; one of them after a PDL kernel is in plain stream order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "commlib/device/ptx.cuh"
#include "commlib/errors.hpp"
#include "kernels/launch.hpp"

namespace commlib::kernels {

// Grid, block, dynamic shared memory and thread-block cluster size (x; 1: no cluster) of a launch.
struct LaunchShape {
  dim3 grid;
  dim3 block;
  size_t smem = 0;
  unsigned cluster = 1;
};

// Launches kernel(args...) with `shape` on `stream` in `order` (cudaLaunchKernelEx with the
// cluster and PDL attributes it needs, none for a plain launch). Returns a Status naming `what`
// and the shape when the launch fails.
template <typename... Params, typename... Args>
Status launch_kernel(const char* what, void (*kernel)(Params...), const LaunchShape& shape, cudaStream_t stream,
                     LaunchOrder order, Args&&... args) {
  cudaLaunchAttribute attrs[2];
  unsigned num_attrs = 0;
  if (shape.cluster > 1) {
    attrs[num_attrs] = cudaLaunchAttribute{};
    attrs[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attrs[num_attrs].val.clusterDim.x = shape.cluster;
    attrs[num_attrs].val.clusterDim.y = 1;
    attrs[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  if (order == LaunchOrder::kProgrammatic) {
    attrs[num_attrs] = cudaLaunchAttribute{};
    attrs[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = shape.grid;
  config.blockDim = shape.block;
  config.dynamicSmemBytes = shape.smem;
  config.stream = stream;
  config.attrs = num_attrs > 0 ? attrs : nullptr;
  config.numAttrs = num_attrs;
  cudaError_t err = cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err == cudaSuccess) return Status::ok();
  return Status(StatusCode::kCudaError,
                detail::concat(what, ": kernel launch failed (", shape.grid.x, " CTAs of ", shape.block.x, " threads",
                               shape.cluster > 1 ? detail::concat(", clusters of ", shape.cluster) : std::string(),
                               "): ", cudaGetErrorString(err)));
}

// The prologue of a kernel that may be launched in `order`: every thread of every block calls it
// first, before any memory access and any early return (Note [programmatic dependent launch]).
__device__ __forceinline__ void pdl_begin(LaunchOrder order) {
  if (order == LaunchOrder::kProgrammatic) {
    device::griddepcontrol_wait();  // the previous grid completed; its writes are visible here
    device::griddepcontrol_launch_dependents();  // the next grid may take free SM slots (rule 3)
  }
}

}  // namespace commlib::kernels
