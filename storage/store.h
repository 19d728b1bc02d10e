// Durable state of the coordinator in one SQLite file (WAL mode): sweeps, trials, attempts,
// results, agents. All SQL uses bound parameters. docs/STORAGE.md documents the schema.
//
// Thread-safety: a Store serialises its own calls (one connection, one mutex); open one Store per
// process.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/backend_config.h"
#include "api/trial.h"

namespace infersweep {

enum class TrialState { kQueued, kLeased, kDone, kCancelled };

struct SweepRecord {
  int64_t id = 0;
  std::string name;
  std::string spec_yaml;     // the submitted text, verbatim
  std::string model;
  int priority = 0;
  std::string state;         // "active", "done", "cancelled"
  int64_t created_unix_ms = 0;
  int64_t trials_total = 0, trials_done = 0;
};

// Which agents may run a trial (from the sweep's selector).
struct Selector {
  std::vector<int> sm_archs;        // empty = any, e.g. {90, 120}
  std::string gpu_name_regex;       // empty = any (RE2 syntax, searched in the GPU name)
  int64_t min_memory_bytes = 0;
  int gpus_needed = 1;
  // The leased GPUs must reach each other by peer access (every pair), as the custom and fused
  // all-reduces need.
  bool needs_p2p = false;
  Device device = Device::kCuda;    // cpu trials run on CPU agents
};

// Where a leased trial runs: the GPU name and SM of the agent slot it was leased for ("cpu" and 0
// for a CPU slot). A result the store makes for the trial without the agent (a lease lost for
// the last time) is filed under it.
struct LeasePlace {
  std::string gpu_name;
  int sm = 0;
};

struct LeaseRequest {
  std::string trial_id;
  std::string agent_id;
  int64_t expires_unix_ms = 0;
  LeasePlace place;
};

struct TrialRecord {
  std::string trial_id;             // "<sweep>-<index>", stable
  int64_t sweep_id = 0;
  std::string model;
  int layers = 0;
  uint64_t seed = 1;
  BackendConfig config;
  Workload workload;
  Selector selector;
  int priority = 0;
  TrialState state = TrialState::kQueued;
  int attempt = 0;                  // attempts started so far
  std::string leased_to;            // agent id while leased
  int64_t lease_expires_unix_ms = 0;
  LeasePlace lease_place;  // of the current (or last) lease
  // ModelIdentityKey of the model, when known without loading it (presets, filled at submit);
  // a result that carries no identity of its own is filed under it. Empty: unknown.
  std::string model_key;
};

// A lease that ended without a result: it expired, or its agent came back without the trial.
struct LostLease {
  std::string trial_id;
  std::string agent_id;  // the agent that held it
  int attempt = 0;       // the attempt that was lost (= leases of the trial so far)
  // true: the trial is queued again and its next lease is attempt + 1. false: it had reached
  // the attempt cap and is done, with an ERROR result whose reason is `reason`.
  bool requeued = false;
  std::string reason;
};

// How many trials are in each state (every sweep).
struct TrialCounts {
  int64_t queued = 0, leased = 0, done = 0, cancelled = 0;
};

struct AgentRecord {
  std::string agent_id;
  std::string host;
  std::string inventory_json;       // the hello message, as JSON
  int64_t last_seen_unix_ms = 0;
  bool connected = false;
};

struct ResultQuery {
  std::optional<int> sm;
  std::optional<std::string> gpu_name;
  std::optional<std::string> model;
  // Identity filters (docs/STORAGE.md "Identity"): exact ModelIdentityKey ("" matches results
  // whose identity is unknown), exact WorkloadKey, the model's layer count.
  std::optional<std::string> model_key;
  std::optional<std::string> workload;
  std::optional<int> layers;
  std::optional<int64_t> sweep_id;
  std::optional<TrialStatus> status;
  // With each batch's kernel log (BatchFigures' prefill_kernels / decode_kernels), which is
  // most of a GPU result's JSON; false leaves them out.
  bool with_kernels = true;
  std::map<std::string, std::string> axis_values;  // every listed axis must match
  std::optional<int64_t> since_unix_ms, until_unix_ms;  // since <= finished_unix_ms < until
  int limit = 1000;  // newest first; must be >= 1
};

// One result to store, as RecordResult takes it (RecordResults stores many in one transaction).
struct ResultSubmission {
  std::string agent_id;  // empty for results made by the coordinator (e.g. UNSUPPORTED)
  std::string gpu_name;
  int sm = 0;
  TrialResult result;
};

struct StoreOptions {
  // How long a call waits for another connection's lock before failing with Unavailable.
  int busy_timeout_ms = 5000;
  // The WAL starts over (a RESTART checkpoint) once it holds more than this, also under
  // sustained ingest, and is cut back to this size when it does.
  int64_t wal_limit_bytes = 32 << 20;
  // The mode a new database file (and so its -wal and -shm) gets, whatever the umask: 0600, or
  // 0640 for a group reader (a Grafana SQLite data source).
  unsigned file_mode = 0600;
};

struct StoredResult {
  int64_t result_id = 0;
  int64_t sweep_id = 0;
  std::string agent_id;
  std::string gpu_name;
  int sm = 0;
  // The identity columns (docs/STORAGE.md "Identity"); nullopt where unknown (results stored
  // before identities existed keep what the migration could derive).
  std::optional<std::string> model_key;
  std::optional<std::string> workload;
  std::optional<std::string> engine_version;
  std::optional<std::string> software;  // "" for CPU results
  std::string result_json;              // ToJson(TrialResult) as stored
  TrialResult result;                   // parsed from result_json (QueryResults, Best); empty from
                                        // QueryResultRows
};

// One (model identity, workload) group of OK results at one (model, sm, batch), or of OK
// serving results at one (model, sm, load point): what Best ranks within, never across.
struct ResultGroup {
  std::string model_key;  // "" when unknown
  std::string workload;   // "" when unknown
  std::string load_point;  // serving groups: LoadPointName ("concurrency=4"); "" for lockstep
  int64_t ok_results = 0;
  int64_t first_sweep = 0, last_sweep = 0;
  int64_t last_finished_unix_ms = 0;
};

struct BestQuery {
  std::string model;
  int sm = 0;
  // Lockstep batches: output_tok_s, ttft_ms, tpot_ms or prefill_tok_s. Serving load points:
  // goodput (request_goodput), output_tok_s (output_throughput), output_tok_s_per_user,
  // p99_ttft_ms or p99_tpot_ms. Higher- or lower-is-better as the name implies.
  std::string metric = "output_tok_s";
  int batch = 1;  // 1..kMaxBatchSize; lockstep only
  // Ranks serving load points (serving_points) instead of lockstep batches; implied by a
  // load_point or a metric only serving points have. The two are never ranked together.
  bool serving = false;
  std::optional<std::string> load_point;  // LoadPointName, e.g. "concurrency=4"
  std::optional<int64_t> sweep_id;
  std::optional<std::string> model_key;  // as ResultQuery's
  std::optional<std::string> workload;
  std::optional<int> layers;
};

struct BestAnswer {
  // The groups with OK figures that match the query, newest first. Best ranks only when exactly
  // one matches; with several, `best` is empty and the caller names the choice.
  std::vector<ResultGroup> groups;
  std::optional<StoredResult> best;
};

class Store {
 public:
  // Opens or creates the file, sets WAL and busy_timeout, runs migrations (PRAGMA user_version).
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& path);
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& path,
                                                     const StoreOptions& options);
  virtual ~Store() = default;

  // Inserts a sweep and all its trials in one transaction; returns the sweep id. A non-zero
  // sweep.id is used as the id (AlreadyExists if taken), else a new one is assigned. Trials are
  // stored queued with attempt 0; an empty trial_id becomes "<sweep id>-<index in trials>", and a
  // non-zero trial sweep_id must equal the sweep's id. The sweep is "active" ("done" when it
  // has no trials); trials_total is trials.size(); created_unix_ms 0 means now. A trial with an
  // invalid workload (ValidateWorkload) rejects the whole sweep (InvalidArgument).
  virtual absl::StatusOr<int64_t> CreateSweep(const SweepRecord& sweep,
                                              const std::vector<TrialRecord>& trials) = 0;
  virtual absl::StatusOr<SweepRecord> GetSweep(int64_t id) = 0;
  virtual absl::StatusOr<std::vector<SweepRecord>> ListSweeps() = 0;
  virtual absl::Status CancelSweep(int64_t id) = 0;

  // Queued trials, highest priority first then oldest, at most `limit`.
  virtual absl::StatusOr<std::vector<TrialRecord>> QueuedTrials(int limit) = 0;
  // Trials per state, for the coordinator's metrics (one index scan: call it at most about once
  // a second).
  virtual absl::StatusOr<TrialCounts> CountTrials() = 0;
  // The distinct selectors of a sweep's queued trials.
  virtual absl::StatusOr<std::vector<Selector>> QueuedSelectors(int64_t sweep_id) = 0;
  virtual absl::StatusOr<TrialRecord> GetTrial(const std::string& trial_id) = 0;
  // Queued -> leased, attempt += 1, for a slot described by `place`; fails
  // (FailedPrecondition) if the trial is not queued.
  virtual absl::StatusOr<TrialRecord> LeaseTrial(const std::string& trial_id,
                                                 const std::string& agent_id,
                                                 int64_t expires_unix_ms,
                                                 const LeasePlace& place) = 0;
  absl::StatusOr<TrialRecord> LeaseTrial(const std::string& trial_id, const std::string& agent_id,
                                         int64_t expires_unix_ms) {
    return LeaseTrial(trial_id, agent_id, expires_unix_ms, LeasePlace{});
  }
  // LeaseTrial for many trials in one transaction (the scheduler places a pass's trials at
  // once): each lease's own result, in order; when the transaction itself fails, every lease
  // gets that error and none is made.
  virtual std::vector<absl::StatusOr<TrialRecord>> LeaseTrials(
      const std::vector<LeaseRequest>& leases) = 0;
  virtual absl::Status RenewLeases(const std::string& agent_id, int64_t expires_unix_ms) = 0;

  // Lost leases, in one transaction each call. A trial that has had fewer than `max_attempts`
  // attempts goes back to the queue (its next lease is a new attempt); one that has had
  // `max_attempts` is done, with an ERROR result filed under the lost agent and its lease place,
  // reason "lease lost N times (...)". max_attempts <= 0: no cap.
  //
  // RequeueExpired: every leased trial whose lease expired before `now_unix_ms`, sorted by id.
  virtual absl::StatusOr<std::vector<LostLease>> RequeueExpired(int64_t now_unix_ms,
                                                                int max_attempts) = 0;
  // ReleaseLease: the one lease of `trial_id` held by `agent_id` under `attempt`, which the agent
  // no longer has (`why` says what happened; it ends up in the ERROR reason). FailedPrecondition
  // when the trial is not leased to that agent under that attempt (any more): nothing changes.
  virtual absl::StatusOr<LostLease> ReleaseLease(const std::string& trial_id,
                                                 const std::string& agent_id, int attempt,
                                                 int max_attempts, const std::string& why) = 0;

  // Stores a result and marks the trial done. Idempotent by (trial_id, attempt): storing the same
  // attempt twice is OK and changes nothing. A result for a trial not leased to `agent_id` under
  // that attempt is rejected (PermissionDenied) unless `agent_id` is empty (coordinator-made
  // results such as UNSUPPORTED).
  virtual absl::Status RecordResult(const std::string& agent_id, const std::string& gpu_name,
                                    int sm, const TrialResult& result) = 0;
  // RecordResult for each submission, in order, all in one transaction: all or nothing (the
  // first error is returned and nothing is stored).
  virtual absl::Status RecordResults(const std::vector<ResultSubmission>& results) = 0;
  // RecordResult for each submission, in order, in one transaction, each under its own
  // savepoint: one that fails leaves the others stored (group commit: one durable commit for
  // many results). One status per submission; when the commit itself fails, every submission
  // gets that error and nothing is stored.
  virtual std::vector<absl::Status> RecordResultsEach(
      const std::vector<ResultSubmission>& results) = 0;

  // Stored results of one sweep by status name ("OK": 12, ...).
  virtual absl::StatusOr<std::map<std::string, int64_t>> CountResults(int64_t sweep_id) = 0;
  // Every (model, sm) results are stored under, for metrics that start from 0 at start-up.
  virtual absl::StatusOr<std::vector<std::pair<std::string, int>>> ResultModelArchs() = 0;

  // Newest first, parsed (StoredResult::result filled).
  virtual absl::StatusOr<std::vector<StoredResult>> QueryResults(const ResultQuery& q) = 0;
  // The same rows with the JSON as stored and not parsed: what the coordinator passes on.
  virtual absl::StatusOr<std::vector<StoredResult>> QueryResultRows(const ResultQuery& q) = 0;
  // The fastest OK figure by `metric` at `batch` within one (model identity, workload) group of
  // (model, sm): see BestAnswer. InvalidArgument for an unknown metric or a batch outside
  // [1, kMaxBatchSize].
  virtual absl::StatusOr<BestAnswer> Best(const BestQuery& q) = 0;

  virtual absl::Status UpsertAgent(const AgentRecord& agent) = 0;
  virtual absl::Status SetAgentConnected(const std::string& agent_id, bool connected,
                                         int64_t now_unix_ms) = 0;
  virtual absl::StatusOr<std::vector<AgentRecord>> ListAgents() = 0;
};

}  // namespace infersweep
