#include "harness/rank_supervisor.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/backend_config.h"
#include "api/version.h"
#include "core/wall_clock.h"
#include "engine/fault_injection.h"
#include "engine/rank_context.h"
#include "engine/weights.h"
#include "harness/child_process.h"
#include "harness/executor.h"

namespace infersweep {
namespace {

using Clock = std::chrono::steady_clock;

// Closes the rank's stdin (its worker exits at EOF) and reaps it, SIGKILLing it after a grace of
// two seconds.
void CloseAndReap(PipedChild& child) {
  if (child.in >= 0) {
    close(child.in);
    child.in = -1;
  }
  const auto give_up = Clock::now() + std::chrono::seconds(2);
  while (child.pid > 0 && Clock::now() < give_up) {
    if (waitpid(child.pid, nullptr, WNOHANG) == child.pid) {
      child.pid = -1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  child.Kill();
}

}  // namespace

int RankProcesses(const TrialRequest& request) {
  const int tp = TensorParallelRanks(request.config);
  auto config = NormalizeBackendConfig(request.config);
  if (config.ok() && ConfigDevice(*config) == Device::kCuda && tp > 1) return tp;
  auto fault = ParseFaultInjection(request.inject_fault);
  const bool rank_fault = fault.ok() && (fault->kind == FaultInjection::Kind::kRankKill ||
                                         fault->kind == FaultInjection::Kind::kRankHang);
  return rank_fault ? tp : 0;
}

absl::StatusOr<std::vector<std::string>> ExchangeThroughParent(std::istream& in, std::ostream& out,
                                                               int ranks, const std::string& mine) {
  out << nlohmann::json{{"exchange", mine}}.dump() << std::endl;
  std::string line;
  if (!std::getline(in, line))
    return absl::UnavailableError("rank exchange: the trial's parent closed the pipe");
  auto parsed = nlohmann::json::parse(line, nullptr, false);
  if (parsed.is_discarded() || !parsed.is_object() || !parsed.contains("exchange") ||
      !parsed["exchange"].is_array() || static_cast<int>(parsed["exchange"].size()) != ranks)
    return absl::InvalidArgumentError(absl::StrCat(
        "rank exchange: not {\"exchange\": [one string a rank, ", ranks, " ranks]}: ", line));
  std::vector<std::string> lines;
  for (const auto& entry : parsed["exchange"]) {
    if (!entry.is_string())
      return absl::InvalidArgumentError(
          absl::StrCat("rank exchange: an entry that is not a string: ", line));
    lines.push_back(entry.get<std::string>());
  }
  return lines;
}

SupervisedTrial RunRankTrial(const TrialRequest& request, int ranks, const std::string& handshake,
                             RankSupervisorOptions options) {
  if (options.rank_argv.empty()) options.rank_argv = {"/proc/self/exe", "rank-worker"};
  signal(SIGPIPE, SIG_IGN);  // a dead rank must surface as EPIPE, not kill the parent
  SupervisedTrial out;
  TrialResult& result = out.result;
  result = StartedResult(request);
  std::vector<std::unique_ptr<PipedChild>> children;
  auto finish = [&](TrialStatus status, std::string reason,
                    const std::string& stderr_tail) -> SupervisedTrial {
    NameRequestedModel(request, &result);
    result.status = status;
    result.reason = std::move(reason);
    result.stderr_tail = stderr_tail;
    result.finished_unix_ms = NowUnixMs();
    for (size_t r = 0; r < children.size(); ++r) {
      if (children[r]->pid > 0) {
        children[r]->Kill();  // SIGKILL and reap
        if (out.ranks[r].ended.empty()) out.ranks[r].ended = "killed by the supervisor";
      }
      out.ranks[r].stderr_tail = absl::StrJoin(children[r]->stderr_tail, "\n");
    }
    return std::move(out);
  };
  if (ranks < 1 || ranks > 8)
    return finish(TrialStatus::kError, absl::StrCat("rank processes: ", ranks, " is outside 1..8"),
                  "");

  const nlohmann::json request_json = ToJson(request);
  for (int r = 0; r < ranks; ++r) {
    children.push_back(std::make_unique<PipedChild>());
    out.ranks.push_back({r, -1, "", ""});
    if (absl::Status s = SpawnChild(options.rank_argv, children.back().get(), options.env); !s.ok())
      return finish(TrialStatus::kError, absl::StrCat("rank ", r, ": ", s.message()), "");
    out.ranks[r].pid = children[r]->pid;
  }
  // A rank that died before reading its assignment shows as EOF on its stdout below.
  for (int r = 0; r < ranks; ++r)
    WriteAll(children[r]->in,
             nlohmann::json{
                 {"rank", r}, {"ranks", ranks}, {"handshake", handshake}, {"request", request_json}}
                     .dump() +
                 "\n");

  std::vector<std::optional<TrialResult>> answers(ranks);
  // The exchange round in progress: each rank's line, sent on to every rank once all have one.
  std::vector<std::optional<std::string>> exchange(ranks);
  const auto deadline = Clock::now() + std::chrono::milliseconds(
                                           static_cast<int64_t>(request.workload.timeout_s * 1e3));
  auto take_stderr = [&](PipedChild& c) {
    c.TakeStderrLines(options.stderr_tail_lines, options.on_progress);
  };
  while (true) {
    int answered = 0, dead = -1;
    for (int r = 0; r < ranks; ++r) {
      PipedChild& c = *children[r];
      while (!answers[r] && dead < 0) {
        const size_t nl = c.out_buffer.find('\n');
        if (nl == std::string::npos) {
          if (!c.out_open) dead = r;
          break;
        }
        auto parsed = nlohmann::json::parse(c.out_buffer.substr(0, nl), nullptr, false);
        c.out_buffer.erase(0, nl + 1);
        if (!parsed.is_discarded() && parsed.is_object() && parsed.contains("exchange")) {
          if (!parsed["exchange"].is_string() || exchange[r])
            return finish(TrialStatus::kError,
                          absl::StrCat("rank ", r,
                                       exchange[r] ? " sent a second exchange line in one round"
                                                   : " sent an exchange line that is not a string"),
                          absl::StrJoin(c.stderr_tail, "\n"));
          exchange[r] = parsed["exchange"].get<std::string>();
          continue;
        }
        auto rank_result =
            parsed.is_discarded()
                ? absl::StatusOr<TrialResult>(absl::InvalidArgumentError("a line that is not JSON"))
                : TrialResultFromJson(parsed);
        if (!rank_result.ok())
          return finish(TrialStatus::kError,
                        absl::StrCat("rank ", r,
                                     " wrote an invalid result: ", rank_result.status().message()),
                        absl::StrJoin(c.stderr_tail, "\n"));
        answers[r] = *std::move(rank_result);
        out.ranks[r].ended = "answered";
      }
      answered += answers[r].has_value();
    }
    // Every rank sent its exchange line: each gets all of them, in rank order.
    if (std::all_of(exchange.begin(), exchange.end(),
                    [](const auto& e) { return e.has_value(); })) {
      nlohmann::json all = nlohmann::json::array();
      for (auto& e : exchange) {
        all.push_back(*e);
        e.reset();
      }
      const std::string line = nlohmann::json{{"exchange", all}}.dump() + "\n";
      for (int r = 0; r < ranks; ++r) WriteAll(children[r]->in, line);  // a dead rank: EOF below
    }
    // A rank that answered other than OK ends the trial: the others may wait on it in a
    // collective (or an exchange) that never completes.
    for (int r = 0; r < ranks && answered < ranks; ++r) {
      if (!answers[r] || answers[r]->status == TrialStatus::kOk) continue;
      std::vector<int> stopped;
      for (int q = 0; q < ranks; ++q)
        if (!answers[q] && children[q]->pid > 0) {
          stopped.push_back(q);
          out.ranks[q].ended = absl::StrCat("killed (SIGKILL) after rank ", r, " answered ",
                                            std::string(TrialStatusName(answers[r]->status)));
        }
      for (auto& c : children) take_stderr(*c);
      TrialResult picked = *std::move(answers[r]);
      if (r != 0) picked.reason = absl::StrCat("rank ", r, ": ", picked.reason);
      SupervisedTrial ended = finish(picked.status, picked.reason, picked.stderr_tail);
      ended.result = std::move(picked);
      return ended;
    }
    if (dead >= 0) {
      // The first rank found dead: collect the rest of its stderr, then how it ended.
      PipedChild& c = *children[dead];
      while (c.err_open) {
        pollfd fd = {c.err, POLLIN, 0};
        if (poll(&fd, 1, 2000) <= 0) break;
        c.err_open = ReadSome(c.err, c.err_buffer);
      }
      if (!c.err_buffer.empty()) c.err_buffer.push_back('\n');
      take_stderr(c);
      const std::string how = ReapAndDescribe(c.pid, absl::StrCat("rank ", dead));
      c.pid = -1;
      out.ranks[dead].ended = how;
      std::vector<int> aborted;
      for (int r = 0; r < ranks; ++r)
        if (r != dead && children[r]->pid > 0 && !answers[r]) {
          aborted.push_back(r);
          out.ranks[r].ended = absl::StrCat("killed (SIGKILL) after rank ", dead, " died");
        }
      return finish(TrialStatus::kCrashed,
                    absl::StrCat(how, aborted.empty() ? "" : "; ranks still running killed: ",
                                 absl::StrJoin(aborted, ", ")),
                    absl::StrJoin(c.stderr_tail, "\n"));
    }
    if (answered == ranks) break;
    const auto now = Clock::now();
    if (now >= deadline) {
      std::vector<int> silent;
      std::string tail;
      for (int r = 0; r < ranks; ++r)
        if (!answers[r]) {
          silent.push_back(r);
          take_stderr(*children[r]);
          if (tail.empty()) tail = absl::StrJoin(children[r]->stderr_tail, "\n");
          out.ranks[r].ended = "killed (SIGKILL) at the timeout";
        }
      return finish(TrialStatus::kTimeout,
                    absl::StrCat("no result from rank ", absl::StrJoin(silent, ", "), " within ",
                                 request.workload.timeout_s, " s; every rank killed"),
                    tail);
    }
    std::vector<pollfd> fds;
    for (int r = 0; r < ranks; ++r) {
      fds.push_back({children[r]->out_open ? children[r]->out : -1, POLLIN, 0});
      fds.push_back({children[r]->err_open ? children[r]->err : -1, POLLIN, 0});
    }
    const int wait_ms = static_cast<int>(std::min<int64_t>(
        1000, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1));
    if (poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR)
      return finish(TrialStatus::kError, absl::StrCat("poll: ", strerror(errno)), "");
    for (int r = 0; r < ranks; ++r) {
      PipedChild& c = *children[r];
      if (c.out_open && (fds[2 * r].revents & (POLLIN | POLLHUP | POLLERR)))
        c.out_open = ReadSome(c.out, c.out_buffer);
      if (c.err_open && (fds[2 * r + 1].revents & (POLLIN | POLLHUP | POLLERR))) {
        c.err_open = ReadSome(c.err, c.err_buffer);
        take_stderr(c);
      }
    }
  }
  // Every rank answered: they exit at the EOF of their stdin.
  for (auto& c : children) {
    take_stderr(*c);
    CloseAndReap(*c);
  }
  int pick = 0;
  for (int r = 1; r < ranks && answers[0]->status == TrialStatus::kOk; ++r)
    if (answers[r]->status != TrialStatus::kOk) pick = r;
  TrialResult picked = *std::move(answers[pick]);
  if (pick != 0) picked.reason = absl::StrCat("rank ", pick, ": ", picked.reason);
  out.result = std::move(picked);
  for (size_t r = 0; r < children.size(); ++r)
    out.ranks[r].stderr_tail = absl::StrJoin(children[r]->stderr_tail, "\n");
  return out;
}

int RankWorkerMain() {
  std::string line;
  if (!std::getline(std::cin, line)) return 2;
  auto parsed = nlohmann::json::parse(line, nullptr, false);
  TrialResult result;
  result.status = TrialStatus::kError;
  if (parsed.is_discarded() || !parsed.is_object() || !parsed.contains("rank") ||
      !parsed.contains("ranks") || !parsed.contains("request")) {
    result.reason = "rank assignment: not a JSON object with rank, ranks and request";
  } else {
    const int rank = parsed["rank"].get<int>(), ranks = parsed["ranks"].get<int>();
    const std::string handshake = parsed.value("handshake", "");
    SetProcessRank(rank);
    std::cerr << "rank " << rank << "/" << ranks << ": handshake '" << handshake << "'"
              << std::endl;
    auto request = TrialRequestFromJson(parsed["request"]);
    auto config = request.ok() ? NormalizeBackendConfig(request->config)
                               : absl::StatusOr<BackendConfig>(request.status());
    // A CUDA rank takes its GPU before any other CUDA call (the executor's, the reference's).
    absl::Status device = config.ok() && ConfigDevice(*config) == Device::kCuda
                              ? UseRankDevice(rank, ranks)
                              : absl::OkStatus();
    SetRankContext({rank, ranks, [ranks](const std::string& mine) {
                      return ExchangeThroughParent(std::cin, std::cout, ranks, mine);
                    }});
    if (!request.ok()) {
      result.reason = std::string(request.status().message());
    } else if (!device.ok()) {
      result = StartedResult(*request);
      result.status = TrialStatus::kError;
      result.reason = std::string(device.message());
    } else {
      TrialExecutor executor;
      const std::string trial_id = request->trial_id;
      result = executor.Execute(*request, [&](const std::string& message) {
        std::cerr << "#progress "
                  << nlohmann::json{{"trial_id", trial_id},
                                    {"message", absl::StrCat("rank ", rank, ": ", message)}}
                         .dump()
                  << std::endl;
      });
    }
  }
  std::cout << ToJson(result).dump() << std::endl;
  // Waits for the supervisor to close stdin, so that it reaps a process that has answered.
  while (std::getline(std::cin, line)) {
  }
  return 0;
}

}  // namespace infersweep
