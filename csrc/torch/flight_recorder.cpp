// Note [flight recorder]
// torch keeps one flight recorder per process for the backends that have no GPU events
// (FlightRecorder<c10::Event>: gloo records into it, `_dump_fr_trace()` dumps it, torch's analyzer
// reads the dumps). Its accessor is an inline template whose instance libtorch keeps private, so
// commlib finds that instance the way a debugger would: the address of the accessor's static
// (`FlightRecorder<c10::Event>::get()::instance`) from libtorch's symbol table, the library's load
// address from dladdr. The object's layout is torch's header's (FlightRecorder.hpp) for the same
// torch this extension is built against; commlib adds entries under the recorder's own mutex
// exactly as its record() does, and dumps with torch's exported dump_fr_trace. Where the symbol
// cannot be found (a stripped libtorch) nothing is recorded and the first call warns once;
// shares_torch_recorder() says which.
// Entry names are those of the library the call stands in for (profiling_name in the header), as
// the analyzer accepts no others. A collective that fails carries commlib's error text (the waiting
// rank, the peer, the phase, the flag values seen; ':' written '=') at the end of its name, so the
// dump and the analyzer show it; a send / recv cannot (the analyzer parses its second word).
// States: an entry is recorded "scheduled" when the call is accepted, marked started when it is
// issued (enqueued on its stream) and completed when commlib knows it finished (CPU calls: on
// return; GPU calls: when a later call of the group, or a dump, finds the event recorded after
// the call passed). Those events come from a pool per group, recorded without timing: creating and
// destroying one per call cost more than the call itself on a VM's driver, and the recorder is on
// by default (torch's TORCH_FR_BUFFER_SIZE is 2000 unless set).
#include "torch/flight_recorder.hpp"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace commlib::torch_layer::fr {
namespace {

using Recorder = c10d::FlightRecorder<c10::Event>;

// The value of `symbol` in the ELF symbol table (.symtab) of the file `path`, or 0.
uintptr_t symtab_value(const char* path, const char* symbol) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  struct stat st {};
  uintptr_t value = 0;
  if (::fstat(fd, &st) == 0 && st.st_size > static_cast<off_t>(sizeof(Elf64_Ehdr))) {
    void* map = ::mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map != MAP_FAILED) {
      const auto* base = static_cast<const uint8_t*>(map);
      const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(base);
      const size_t size = static_cast<size_t>(st.st_size);
      const bool elf64 = std::memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 && eh->e_ident[EI_CLASS] == ELFCLASS64;
      if (elf64 && eh->e_shoff + size_t{eh->e_shnum} * sizeof(Elf64_Shdr) <= size) {
        const auto* sh = reinterpret_cast<const Elf64_Shdr*>(base + eh->e_shoff);
        for (int i = 0; i < eh->e_shnum && value == 0; ++i) {
          if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_link >= eh->e_shnum) continue;
          const Elf64_Shdr& strtab = sh[sh[i].sh_link];
          if (sh[i].sh_offset + sh[i].sh_size > size || strtab.sh_offset + strtab.sh_size > size) continue;
          const auto* syms = reinterpret_cast<const Elf64_Sym*>(base + sh[i].sh_offset);
          const char* names = reinterpret_cast<const char*>(base + strtab.sh_offset);
          for (size_t s = 0; s < sh[i].sh_size / sizeof(Elf64_Sym); ++s) {
            if (syms[s].st_name < strtab.sh_size && std::strcmp(names + syms[s].st_name, symbol) == 0) {
              value = syms[s].st_value;
              break;
            }
          }
        }
      }
      ::munmap(map, st.st_size);
    }
  }
  ::close(fd);
  return value;
}

struct Located {
  Recorder* recorder = nullptr;
  bool shared = false;
};

const Located& located() {
  static const Located where = [] {
    Located l;
    Dl_info info{};
    // dump_fr_trace is exported by the library that holds the recorder; calling it also makes the
    // recorder's lazily created instance exist.
    if (::dladdr(reinterpret_cast<void*>(&c10d::dump_fr_trace), &info) != 0 && info.dli_fname != nullptr) {
      (void)c10d::dump_fr_trace(/*includeCollectives=*/false, /*includeStackTraces=*/false, /*onlyActive=*/true);
      const uintptr_t value = symtab_value(info.dli_fname, "_ZZN4c10d14FlightRecorderIN3c105EventEE3getEvE8instance");
      if (value != 0) {
        l.recorder = *reinterpret_cast<Recorder**>(reinterpret_cast<uintptr_t>(info.dli_fbase) + value);
        l.shared = l.recorder != nullptr;
      }
    }
    if (l.recorder == nullptr && std::getenv("TORCH_FR_BUFFER_SIZE") != nullptr &&
        std::atoi(std::getenv("TORCH_FR_BUFFER_SIZE")) > 0) {
      LOG(WARNING) << "commlib: torch's flight recorder was not found in " << (info.dli_fname ? info.dli_fname : "libtorch")
                   << " (no symbol table); ddacomm calls are not recorded";
    }
    return l;
  }();
  return where;
}

Recorder& recorder() { return *located().recorder; }

// Runs fn on the entry of call (id, epoch) if it is still in the ring, under the recorder's mutex.
void with_entry(size_t id, size_t epoch, const std::function<void(Recorder::Entry&)>& fn) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> guard(r.mutex_);
  auto start = r.reset_epoch_start_idx_.find(epoch);
  if (r.entries_.empty() || start == r.reset_epoch_start_idx_.end()) return;
  Recorder::Entry& e = r.entries_.at((start->second + id) % r.max_entries_);  // as getIdxFromId
  if (e.id_ == id && e.reset_epoch_ == epoch) fn(e);
}

// One new entry, as FlightRecorder::recordWithResetEnabled adds it: (id, reset epoch).
std::pair<size_t, size_t> push(size_t pg_id, const std::tuple<std::string, std::string>& pg_name, size_t collective_seq,
                               size_t p2p_seq, size_t op_id, std::string name, const std::vector<at::Tensor>& inputs,
                               const std::vector<at::Tensor>& outputs, std::chrono::milliseconds timeout,
                               const std::shared_ptr<c10d::ProcessGroupStatus>& status, bool p2p) {
  Recorder& r = recorder();
  auto traceback = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/true, r.capture_cpp_stack_);
  Recorder::Entry e{};
  e.pg_id_ = pg_id;
  e.pg_name_ = pg_name;
  e.collective_seq_id_ = collective_seq;
  e.p2p_seq_id_ = p2p_seq;
  e.op_id_ = op_id;
  e.profiling_name_ = std::move(name);
  e.traceback_ = std::move(traceback);
  e.start_ = e.end_ = nullptr;
  e.time_created_ = c10::getTime();
  e.timeout_ms_ = timeout.count();
  e.isP2P_ = p2p;
  for (const auto* list : {&inputs, &outputs}) {
    for (const auto& t : *list) {
      (list == &inputs ? e.input_dtypes_ : e.output_dtypes_).push_back(t.scalar_type());
      (list == &inputs ? e.input_dims_ : e.output_dims_).push_back(t.dim());
      e.sizes_.insert(e.sizes_.end(), t.sizes().begin(), t.sizes().end());
    }
  }
  e.thread_id_ = std::this_thread::get_id();
  std::lock_guard<std::mutex> guard(r.mutex_);
  if (r.all_pg_status_.find(pg_id) == r.all_pg_status_.end()) r.all_pg_status_[pg_id] = status;
  e.id_ = r.id_;
  e.reset_epoch_ = r.reset_epoch_;
  const size_t next = r.next_++;
  if (r.entries_.size() < r.max_entries_) {
    r.entries_.emplace_back(std::move(e));
  } else {
    r.entries_[next] = std::move(e);
  }
  if (r.next_ == r.max_entries_) r.next_ = 0;
  return {r.id_++, r.reset_epoch_};
}

std::atomic<size_t> next_pg_id{1u << 20};  // apart from the ids torch's own groups take

// The recorder keeps each group's configuration (ranks, status) for as long as the process lives;
// commlib drops its own groups' once they are destroyed and no entry of the ring refers to them
// (a group destroyed while its entries are still in the ring waits in `retired` for the next sweep),
// and a name only when no live group shares it. Under the recorder's mutex.
struct GroupKeys {
  size_t pg_id;
  std::tuple<std::string, std::string> name;
};
// Never destroyed (as torch's recorder is not): a group may outlive the static destructors.
std::vector<GroupKeys>& retired_groups() {
  static auto* retired = new std::vector<GroupKeys>();
  return *retired;
}
std::map<std::tuple<std::string, std::string>, int>& live_group_names() {
  static auto* live = new std::map<std::tuple<std::string, std::string>, int>();
  return *live;
}

void sweep_retired_groups(Recorder& r) {
  auto& retired = retired_groups();
  if (retired.empty()) return;
  std::unordered_set<size_t> in_ring;
  for (const auto& e : r.entries_) in_ring.insert(e.pg_id_);
  auto& live = live_group_names();
  std::erase_if(retired, [&](const GroupKeys& g) {
    if (in_ring.count(g.pg_id) != 0) return false;
    r.all_pg_status_.erase(g.pg_id);
    if (live.count(g.name) == 0) r.pg_name_to_ranks_.erase(g.name);
    return true;
  });
}

}  // namespace

bool enabled() {
  static const bool on = located().recorder != nullptr && located().recorder->enabled_;
  return on;
}

bool shares_torch_recorder() { return located().shared; }

Group::Group(std::string name, std::string description, std::vector<uint64_t> global_ranks, int rank,
             std::chrono::milliseconds timeout)
    : name_(std::move(name), std::move(description)),
      pg_id_(next_pg_id++),
      rank_(rank),
      timeout_(timeout),
      status_(std::make_shared<c10d::ProcessGroupStatus>()) {
  if (!enabled()) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> guard(r.mutex_);
  r.pg_name_to_ranks_[name_] = std::move(global_ranks);
  ++live_group_names()[name_];
  sweep_retired_groups(r);
}

Group::~Group() {
  if (!enabled()) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> guard(r.mutex_);
  auto& live = live_group_names();
  if (--live[name_] == 0) live.erase(name_);
  retired_groups().push_back({pg_id_, name_});
  sweep_retired_groups(r);
}

Group::Call Group::record(std::string name, bool p2p, const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& outputs) {
  Call call;
  if (!enabled()) return call;
  const size_t seq = p2p ? ++p2p_seq_ : ++collective_seq_;
  if (!p2p) {
    status_->lastEnqueuedSeq = static_cast<int64_t>(seq);
    status_->lastEnqueuedWorkName = name;
  }
  const auto [id, epoch] = push(pg_id_, name_, p2p ? 0 : seq, p2p ? seq : 0, ++op_id_, std::move(name), inputs,
                                outputs, timeout_, status_, p2p);
  call.id_ = id;
  call.epoch_ = epoch;
  return call;
}

void Group::issued(Call call, const c10::Stream& stream) {
  if (!call.recorded()) return;
  call.started();  // enqueued on its stream
  std::lock_guard<std::mutex> guard(gpu_mutex_);
  poll_locked();
  auto it = std::find_if(free_events_.rbegin(), free_events_.rend(), [&](const c10::Event& e) {
    return e.device_index() == stream.device_index();
  });
  c10::Event done = it == free_events_.rend() ? c10::Event(stream.device_type()) : std::move(*it);
  if (it != free_events_.rend()) free_events_.erase(std::next(it).base());
  done.record(stream);
  pending_.emplace_back(std::move(done), std::move(call));
}

void Group::poll() {
  std::lock_guard<std::mutex> guard(gpu_mutex_);
  poll_locked();
}

void Group::poll_locked() {
  while (!pending_.empty() && pending_.front().first.query()) {
    pending_.front().second.completed();
    free_events_.push_back(std::move(pending_.front().first));
    pending_.pop_front();
  }
}

void Group::Call::started() {
  if (!id_) return;
  with_entry(*id_, epoch_, [](Recorder::Entry& e) {
    if (!e.time_discovered_started_) e.time_discovered_started_ = c10::getTime();
  });
}

void Group::Call::completed() {
  if (!id_) return;
  with_entry(*id_, epoch_, [](Recorder::Entry& e) {
    const auto now = c10::getTime();
    if (!e.time_discovered_started_) e.time_discovered_started_ = now;
    e.time_discovered_completed_ = now;
    e.retired_ = true;
  });
  id_.reset();
}

void Group::Call::timed_out(const std::string& what) {
  if (!id_) return;
  // The analyzer splits the name at ':' (library:op) and reads a send's / recv's second word, so
  // the note goes only on collectives, with no ':' in it.
  std::string note = what;
  std::replace(note.begin(), note.end(), ':', '=');
  std::replace(note.begin(), note.end(), '\n', ' ');
  with_entry(*id_, epoch_, [&](Recorder::Entry& e) {
    if (!e.isP2P_) e.profiling_name_ += " [" + note + "]";
  });
}

std::string profiling_name(bool cuda, const std::string& op, const std::string& variant, int rank, int peer) {
  std::string name = std::string(cuda ? "nccl:" : "gloo:") + op;
  if (op == "send") return name + " " + std::to_string(rank) + "->" + std::to_string(peer);
  if (op == "recv") return name + " " + std::to_string(rank) + "<-" + std::to_string(peer);
  return variant.empty() ? name : name + " ddacomm." + variant;
}

bool dump_requested() {
  static const bool requested = std::getenv("TORCH_FR_DUMP_TEMP_FILE") != nullptr;
  return requested;
}

std::string dump() {
  return c10d::dump_fr_trace(/*includeCollectives=*/true, /*includeStackTraces=*/true, /*onlyActive=*/false);
}

std::string dump_to_file(int rank) {
  if (!enabled()) return "";
  try {
    c10d::DebugInfoWriter& writer = c10d::DebugInfoWriter::getWriter(rank);
    writer.write(dump());
    return writer.getWriterTarget();
  } catch (const std::exception& e) {
    LOG(ERROR) << "commlib: writing the flight recorder dump failed: " << e.what();
    return "";
  }
}

}  // namespace commlib::torch_layer::fr

#include "torch/bindings.hpp"

namespace commlib::torch_layer::fr {
namespace {

namespace py = pybind11;

BindingRegistrar reg("flight_recorder", [](py::module_& m) {
  m.def("fr_enabled", &enabled, "Whether torch's flight recorder keeps entries (TORCH_FR_BUFFER_SIZE > 0).");
  m.def("fr_shares_torch_recorder", &shares_torch_recorder,
        "Whether commlib records into torch's own flight recorder (Note [flight recorder]).");
  py::class_<Group::Call>(m, "FrCall")
      .def("started", &Group::Call::started)
      .def("completed", &Group::Call::completed)
      .def("timed_out", &Group::Call::timed_out, py::arg("what"))
      .def_property_readonly("recorded", &Group::Call::recorded);
  py::class_<Group, std::shared_ptr<Group>>(m, "FrGroup")
      .def(py::init([](std::string name, std::string desc, std::vector<uint64_t> ranks, int rank, int64_t timeout_ms) {
             return std::make_shared<Group>(std::move(name), std::move(desc), std::move(ranks), rank,
                                            std::chrono::milliseconds(timeout_ms));
           }),
           py::arg("name"), py::arg("description"), py::arg("global_ranks"), py::arg("rank"), py::arg("timeout_ms"))
      .def(
          "record",
          [](Group& g, const std::string& name, bool p2p, const std::vector<at::Tensor>& in,
             const std::vector<at::Tensor>& out, bool started) {
            Group::Call call = g.record(name, p2p, in, out);
            if (started) call.started();
            return call;
          },
          py::arg("name"), py::arg("p2p"), py::arg("inputs"), py::arg("outputs"), py::arg("started") = false)
      .def(
          "issued",
          [](Group& g, Group::Call& call, int device) {
            if (device < 0) {  // a CPU call: done on return
              call.completed();
              return;
            }
            const c10::Device dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
            g.issued(std::exchange(call, Group::Call()), c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(dev));
          },
          py::arg("call"), py::arg("device"),
          "The call returned: a CPU call (device -1) completes now, a GPU call when the GPU passes "
          "this point of the device's current stream.")
      .def("poll", &Group::poll, "Completes the entries of the GPU calls that have finished.");
  m.def("fr_profiling_name", &profiling_name, py::arg("cuda"), py::arg("op"), py::arg("variant"), py::arg("rank"),
        py::arg("peer") = -1, "The entry name torch's analyzer reads (Note [flight recorder]).");
  m.def("fr_dump_requested", &dump_requested, "Whether failures write dumps (TORCH_FR_DUMP_TEMP_FILE is set).");
  m.def("fr_dump_to_file", &dump_to_file, py::arg("rank"),
        "Writes torch's flight-recorder dump to TORCH_FR_DUMP_TEMP_FILE + rank; returns the file, or ''.");
});

}  // namespace
}  // namespace commlib::torch_layer::fr
