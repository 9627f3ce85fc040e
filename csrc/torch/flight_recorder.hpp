// commlib's calls in torch's own flight recorder (Note [flight recorder]).
//
// Every "ddacomm" call and every direct-API call records one entry into the recorder that gloo and
// NCCL record into, so `torch._C._distributed_c10d._dump_fr_trace()` and torch's analyzer
// (`python -m torch.distributed.flight_recorder.fr_trace`) see them. With TORCH_FR_BUFFER_SIZE=0
// (torch's default outside NCCL jobs) every function here returns at its first branch.
// Thread-safe (the recorder's own mutex).
#pragma once

#include <ATen/ATen.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace c10d {
struct ProcessGroupStatus;
}

namespace commlib::torch_layer::fr {

// Whether torch's flight recorder keeps entries (TORCH_FR_BUFFER_SIZE, read once by torch).
bool enabled();
// Whether the entries go into torch's own recorder (else into commlib's instance of the same
// recorder, dumped by dump() alone: a torch build without the symbol, Note [flight recorder]).
bool shares_torch_recorder();

// One group as the recorder knows it: its id, (name, description) and ranks, registered once.
class Group {
 public:
  Group(std::string name, std::string description, std::vector<uint64_t> global_ranks, int rank,
        std::chrono::milliseconds timeout);
  // Drops the group's configuration from the recorder once no entry of the ring refers to it, so a
  // process that makes communicators again and again does not grow (bench/results/soak.md).
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }
  int rank() const { return rank_; }

  // A call: its entry moves scheduled -> started -> completed. Collectives take the group's next
  // collective sequence number, point-to-point calls the next p2p one, as ProcessGroupNCCL's do.
  class Call {
   public:
    Call() = default;
    void started();
    void completed();
    // The call timed out: `what` (rank, peer, phase, flag values) is appended to its name.
    void timed_out(const std::string& what);
    bool recorded() const { return id_.has_value(); }

   private:
    friend class Group;
    std::optional<size_t> id_;
    size_t epoch_ = 0;
  };
  // `name` is the entry's profiling name (profiling_name below).
  Call record(std::string name, bool p2p, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);

  // A call was enqueued on `stream` (a GPU stream): its entry is started now and completes once
  // the GPU has passed this point, found by a later issued() or poll() of this group. The events
  // come from a pool of the group's (creating and destroying one per call costs more than the
  // call), recorded without timing. A call that is not recorded costs nothing here.
  void issued(Call call, const c10::Stream& stream);
  // Completes the entries of the GPU calls that have finished (in issue order).
  void poll();

 private:
  void poll_locked();
  std::tuple<std::string, std::string> name_;
  size_t pg_id_;
  int rank_;
  std::chrono::milliseconds timeout_;
  size_t collective_seq_ = 0;
  size_t p2p_seq_ = 0;
  size_t op_id_ = 0;
  std::shared_ptr<c10d::ProcessGroupStatus> status_;
  std::mutex gpu_mutex_;  // guards pending_ and free_events_
  std::deque<std::pair<c10::Event, Call>> pending_;
  std::vector<c10::Event> free_events_;
};

// The profiling name torch's analyzer reads: "<library>:<op> <detail>", where <library> is the one
// the call stands in for ("nccl" for CUDA tensors, "gloo" for CPU ones; the analyzer knows no other
// names), <op> one of its operation names (all_reduce, _all_gather_base, send, ...) and <detail>
// "ddacomm.<variant>" for a collective or "<rank>-><peer>" / "<rank><-<peer>" for a send / recv.
std::string profiling_name(bool cuda, const std::string& op, const std::string& variant, int rank, int peer);

// Whether failures write dumps: TORCH_FR_DUMP_TEMP_FILE is set (symbolizing the stacks of a dump
// takes seconds, so a failure pays for it only when someone asked for the files).
bool dump_requested();

// torch's dump (pickle) of the recorder, as `_dump_fr_trace()` returns it.
std::string dump();
// Writes dump() where ProcessGroupNCCL writes its own: TORCH_FR_DUMP_TEMP_FILE + rank (torch's
// DebugInfoWriter). Never throws; returns the file written, or "" when disabled.
std::string dump_to_file(int rank);

}  // namespace commlib::torch_layer::fr
