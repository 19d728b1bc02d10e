#include "storage/schema.h"

#include <sqlite3.h>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "storage/sqlite.h"

namespace infersweep {

const std::vector<Migration>& Migrations() {
  static const std::vector<Migration> migrations = {
      {"sweeps, trials, results, result_axes, agents",
       R"sql(
CREATE TABLE sweeps (
  sweep_id      INTEGER PRIMARY KEY AUTOINCREMENT,
  name          TEXT    NOT NULL,
  spec_yaml     TEXT    NOT NULL,
  model         TEXT    NOT NULL,
  priority      INTEGER NOT NULL DEFAULT 0,
  state         TEXT    NOT NULL DEFAULT 'active'
                CHECK (state IN ('active', 'done', 'cancelled')),
  created_ms    INTEGER NOT NULL,
  trials_total  INTEGER NOT NULL DEFAULT 0,
  trials_done   INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE trials (
  trial_id          TEXT    PRIMARY KEY,
  sweep_id          INTEGER NOT NULL REFERENCES sweeps(sweep_id),
  model             TEXT    NOT NULL,
  layers            INTEGER NOT NULL,
  seed              INTEGER NOT NULL,      -- uint64 stored as its int64 bit pattern
  config_json       TEXT    NOT NULL,      -- {"axis": "value", ...}
  config_string     TEXT    NOT NULL,      -- canonical "a=b,c=d"
  workload_json     TEXT    NOT NULL,
  selector_json     TEXT    NOT NULL,
  priority          INTEGER NOT NULL,
  state             TEXT    NOT NULL
                    CHECK (state IN ('queued', 'leased', 'done', 'cancelled')),
  attempt           INTEGER NOT NULL DEFAULT 0,
  leased_to         TEXT,                  -- agent id; NULL when never leased or requeued
  lease_expires_ms  INTEGER,
  created_ms        INTEGER NOT NULL
);
CREATE INDEX trials_queue ON trials(state, priority DESC, created_ms);
CREATE INDEX trials_sweep ON trials(sweep_id);
CREATE INDEX trials_leases ON trials(leased_to) WHERE state = 'leased';

CREATE TABLE results (
  result_id             INTEGER PRIMARY KEY,
  trial_id              TEXT    NOT NULL REFERENCES trials(trial_id),
  attempt               INTEGER NOT NULL,
  sweep_id              INTEGER NOT NULL REFERENCES sweeps(sweep_id),
  agent_id              TEXT    NOT NULL,  -- '' for results made by the coordinator
  gpu_name              TEXT    NOT NULL,
  sm                    INTEGER NOT NULL,
  model                 TEXT    NOT NULL,
  status                TEXT    NOT NULL,  -- TrialStatusName: OK, INCORRECT, ...
  config_string         TEXT    NOT NULL,
  result_json           TEXT    NOT NULL,  -- ToJson(TrialResult)
  output_tok_s          REAL,              -- batch 1, median over repeats; NULL if not measured
  output_tok_s_max_batch REAL,             -- at the largest batch of the workload
  max_batch             INTEGER,
  ttft_ms_p50           REAL,              -- batch 1, median
  tpot_ms               REAL,              -- batch 1, median
  finished_ms           INTEGER NOT NULL,
  UNIQUE (trial_id, attempt)
);
-- (sm, model, status) filters; finished_ms last so the newest-first order needs no sort.
CREATE INDEX results_sm_model_status ON results(sm, model, status, finished_ms);
CREATE INDEX results_finished ON results(finished_ms);
CREATE INDEX results_sm_finished ON results(sm, finished_ms);  -- newest results of one GPU arch
CREATE INDEX results_best ON results(model, sm, status, output_tok_s);
CREATE INDEX results_sweep ON results(sweep_id);

CREATE TABLE result_axes (
  result_id  INTEGER NOT NULL REFERENCES results(result_id) ON DELETE CASCADE,
  axis       TEXT    NOT NULL,
  value      TEXT    NOT NULL,
  PRIMARY KEY (result_id, axis)
) WITHOUT ROWID;
CREATE INDEX result_axes_lookup ON result_axes(axis, value, result_id);

CREATE TABLE agents (
  agent_id        TEXT    PRIMARY KEY,
  host            TEXT    NOT NULL,
  inventory_json  TEXT    NOT NULL,
  last_seen_ms    INTEGER NOT NULL,
  connected       INTEGER NOT NULL DEFAULT 0
);
)sql"},
      {"trials: where each lease runs (lease_gpu_name, lease_sm)",
       R"sql(
ALTER TABLE trials ADD COLUMN lease_gpu_name TEXT NOT NULL DEFAULT '';
ALTER TABLE trials ADD COLUMN lease_sm INTEGER NOT NULL DEFAULT 0;
)sql"},
      {"result_batches: one row of figures per measured batch size, filled from result_json",
       R"sql(
CREATE TABLE result_batches (
  result_id      INTEGER NOT NULL REFERENCES results(result_id) ON DELETE CASCADE,
  batch          INTEGER NOT NULL,
  model          TEXT    NOT NULL,   -- the result's, so Best filters without a join
  sm             INTEGER NOT NULL,
  ok             INTEGER NOT NULL,   -- status = 'OK'
  output_tok_s   REAL,               -- medians over repeats; NULL when not measured
  ttft_ms        REAL,
  tpot_ms        REAL,
  prefill_tok_s  REAL,
  -- Clustered by what Best filters on: the rows of one model, sm and batch are contiguous, so a
  -- latency metric is a range scan with no lookups; (result_id, batch) stays unique.
  PRIMARY KEY (model, sm, batch, result_id)
) WITHOUT ROWID;
CREATE INDEX result_batches_best ON result_batches(model, sm, batch, ok, output_tok_s);
-- The first entry of a batch size wins, as the json_each query this replaces read it.
INSERT OR IGNORE INTO result_batches
  (result_id, batch, model, sm, ok, output_tok_s, ttft_ms, tpot_ms, prefill_tok_s)
SELECT r.result_id, json_extract(b.value, '$.batch'), r.model, r.sm, r.status = 'OK',
       json_extract(b.value, '$.output_tok_s.median'), json_extract(b.value, '$.ttft_ms.median'),
       json_extract(b.value, '$.tpot_ms.median'), json_extract(b.value, '$.prefill_tok_s.median')
FROM results AS r, json_each(r.result_json, '$.batches') AS b
WHERE json_valid(r.result_json) AND json_extract(b.value, '$.batch') IS NOT NULL
ORDER BY r.result_id, b.key;
)sql"},
      {"results keyed by identity (model_key, workload, engine version, software stack); "
       "configs interned (configs, config_axes; trials and results point at them); kernel logs "
       "interned; compressed result JSON; result_batches and result_groups by identity",
       R"sql(
-- Each distinct config once; trials and results point at it. An axis filter is a lookup in
-- config_axes (a few thousand rows) instead of one result_axes row per axis per result.
CREATE TABLE configs (
  config_id      INTEGER PRIMARY KEY,
  config_string  TEXT    NOT NULL UNIQUE
);
CREATE TABLE config_axes (
  axis       TEXT    NOT NULL,
  value      TEXT    NOT NULL,
  config_id  INTEGER NOT NULL REFERENCES configs(config_id),
  PRIMARY KEY (axis, value, config_id)
) WITHOUT ROWID;
INSERT INTO configs (config_string)
  SELECT config_string FROM results UNION SELECT config_string FROM trials ORDER BY 1;
INSERT OR IGNORE INTO config_axes (axis, value, config_id)
  SELECT a.axis, a.value, c.config_id
  FROM result_axes AS a JOIN results AS r USING (result_id)
       JOIN configs AS c ON c.config_string = r.config_string;
INSERT OR IGNORE INTO config_axes (axis, value, config_id)
  SELECT j.key, j.value, c.config_id
  FROM trials AS t JOIN configs AS c ON c.config_string = t.config_string,
       json_each(t.config_json) AS j
  WHERE json_valid(t.config_json);

-- One batch's kernel log ({"prefill": ..., "decode": ...}) once: a fleet's results repeat them.
-- A result's JSON is stored with "kernels_ref": id in its place (docs/STORAGE.md).
CREATE TABLE kernel_logs (
  kernel_log_id  INTEGER PRIMARY KEY,
  log            TEXT    NOT NULL UNIQUE
);

-- trials, rebuilt: the config by id, and the model's identity where it is known at submit. A
-- preset trial that names its layers gets its identity here; a layer count of 0 (the preset's
-- own) is not something SQL can look up: those stay unknown. (Migrate runs steps with foreign
-- keys off and checks them before each COMMIT, as SQLite's table-rebuild procedure asks.)
CREATE TABLE trials_v4 (
  trial_id          TEXT    PRIMARY KEY,
  sweep_id          INTEGER NOT NULL REFERENCES sweeps(sweep_id),
  model             TEXT    NOT NULL,
  layers            INTEGER NOT NULL,
  seed              INTEGER NOT NULL,      -- uint64 stored as its int64 bit pattern
  config_id         INTEGER NOT NULL REFERENCES configs(config_id),
  workload_json     TEXT    NOT NULL,
  selector_json     TEXT    NOT NULL,
  priority          INTEGER NOT NULL,
  state             TEXT    NOT NULL
                    CHECK (state IN ('queued', 'leased', 'done', 'cancelled')),
  attempt           INTEGER NOT NULL DEFAULT 0,
  leased_to         TEXT,
  lease_expires_ms  INTEGER,
  created_ms        INTEGER NOT NULL,
  lease_gpu_name    TEXT    NOT NULL DEFAULT '',
  lease_sm          INTEGER NOT NULL DEFAULT 0,
  model_key         TEXT,                  -- ModelIdentityKey; NULL: unknown
  workload_key      TEXT    NOT NULL       -- WorkloadKey of workload_json
);
INSERT INTO trials_v4
  SELECT t.trial_id, t.sweep_id, t.model, t.layers, t.seed, c.config_id, t.workload_json,
         t.selector_json, t.priority, t.state, t.attempt, t.leased_to, t.lease_expires_ms,
         t.created_ms, t.lease_gpu_name, t.lease_sm,
         CASE WHEN t.model LIKE 'preset:%' AND t.layers > 0 AND t.seed >= 0 THEN
           'preset:' || CASE WHEN instr(t.model, '@') > 0
                             THEN substr(t.model, 8, instr(t.model, '@') - 8)
                             ELSE substr(t.model, 8) END ||
           ' layers=' || t.layers || ' seed=' || t.seed || ' weights=' ||
           CASE WHEN instr(t.model, '@') > 0 THEN substr(t.model, instr(t.model, '@') + 1)
                ELSE 'bf16' END
         END,
         CASE WHEN json_valid(t.workload_json) THEN
           'prompt=' || COALESCE(json_extract(t.workload_json, '$.prompt_len'), 128) ||
           ',output=' || COALESCE(json_extract(t.workload_json, '$.output_len'), 32) ||
           ',warmup=' || COALESCE(json_extract(t.workload_json, '$.warmup'), 1)
         ELSE '' END
  FROM trials AS t JOIN configs AS c ON c.config_string = t.config_string;
DROP TABLE trials;
ALTER TABLE trials_v4 RENAME TO trials;
CREATE INDEX trials_queue ON trials(state, priority DESC, created_ms);
CREATE INDEX trials_sweep ON trials(sweep_id);
CREATE INDEX trials_leases ON trials(leased_to) WHERE state = 'leased';

ALTER TABLE results ADD COLUMN config_id INTEGER REFERENCES configs(config_id);
ALTER TABLE results ADD COLUMN model_key TEXT;       -- ModelIdentityKey; NULL: unknown
ALTER TABLE results ADD COLUMN model_layers INTEGER; -- NULL: unknown
ALTER TABLE results ADD COLUMN workload TEXT;        -- WorkloadKey; NULL: unknown
ALTER TABLE results ADD COLUMN engine_version TEXT;  -- NULL: unknown
ALTER TABLE results ADD COLUMN software TEXT;        -- SoftwareStackKey ('' on the CPU); NULL: unknown
ALTER TABLE results ADD COLUMN result_blob BLOB;     -- CompressResultJson; result_json is '' then
UPDATE results SET
  config_id = (SELECT config_id FROM configs AS c WHERE c.config_string = results.config_string),
  model_key = (SELECT model_key FROM trials AS t WHERE t.trial_id = results.trial_id),
  model_layers = (SELECT CASE WHEN t.model_key IS NOT NULL THEN t.layers END
                  FROM trials AS t WHERE t.trial_id = results.trial_id),
  workload = (SELECT NULLIF(t.workload_key, '') FROM trials AS t
              WHERE t.trial_id = results.trial_id),
  engine_version = CASE WHEN json_valid(result_json)
                        THEN json_extract(result_json, '$.engine_version') END;
DROP INDEX results_best;  -- result_batches ranks every metric at every batch
DROP TABLE result_axes;
CREATE INDEX results_config ON results(config_id, finished_ms);

-- The (model, sm, batch, model identity, workload) groups: what Best chooses between and
-- ranks within. ok_results counts the OK rows, kept as results arrive.
CREATE TABLE result_groups (
  group_id          INTEGER PRIMARY KEY,
  model             TEXT    NOT NULL,
  sm                INTEGER NOT NULL,
  batch             INTEGER NOT NULL,
  model_key         TEXT    NOT NULL,   -- '' when unknown
  workload          TEXT    NOT NULL,   -- '' when unknown
  ok_results        INTEGER NOT NULL DEFAULT 0,
  first_sweep       INTEGER,            -- of the OK results; NULL while there are none
  last_sweep        INTEGER,
  last_finished_ms  INTEGER,
  UNIQUE (model, sm, batch, model_key, workload)
);
INSERT INTO result_groups (model, sm, batch, model_key, workload)
  SELECT DISTINCT b.model, b.sm, b.batch, COALESCE(r.model_key, ''), COALESCE(r.workload, '')
  FROM result_batches AS b JOIN results AS r USING (result_id);

-- One row per measured batch size, clustered by group (and sweep): one group's rows, or one
-- sweep's rows of a group, are one key range.
CREATE TABLE result_batches_v4 (
  group_id       INTEGER NOT NULL REFERENCES result_groups(group_id),
  sweep_id       INTEGER NOT NULL,
  result_id      INTEGER NOT NULL REFERENCES results(result_id) ON DELETE CASCADE,
  ok             INTEGER NOT NULL,   -- status = 'OK'
  output_tok_s   REAL,               -- medians over repeats; NULL when not measured
  ttft_ms        REAL,
  tpot_ms        REAL,
  prefill_tok_s  REAL,
  PRIMARY KEY (group_id, sweep_id, result_id)
) WITHOUT ROWID;
INSERT INTO result_batches_v4
  SELECT g.group_id, r.sweep_id, b.result_id, b.ok, b.output_tok_s, b.ttft_ms, b.tpot_ms,
         b.prefill_tok_s
  FROM result_batches AS b JOIN results AS r USING (result_id)
       JOIN result_groups AS g ON g.model = b.model AND g.sm = b.sm AND g.batch = b.batch AND
                                  g.model_key = COALESCE(r.model_key, '') AND
                                  g.workload = COALESCE(r.workload, '');
DROP TABLE result_batches;
ALTER TABLE result_batches_v4 RENAME TO result_batches;
CREATE INDEX result_batches_best ON result_batches(group_id, ok, output_tok_s);
UPDATE result_groups SET
  ok_results = (SELECT COUNT(*) FROM result_batches AS b
                WHERE b.group_id = result_groups.group_id AND b.ok = 1),
  first_sweep = (SELECT MIN(sweep_id) FROM result_batches AS b
                 WHERE b.group_id = result_groups.group_id AND b.ok = 1),
  last_sweep = (SELECT MAX(sweep_id) FROM result_batches AS b
                WHERE b.group_id = result_groups.group_id AND b.ok = 1),
  last_finished_ms = (SELECT MAX(r.finished_ms) FROM result_batches AS b
                      JOIN results AS r USING (result_id)
                      WHERE b.group_id = result_groups.group_id AND b.ok = 1);
)sql"},
      {"serving_points: one row of figures per served load point, by identity and load point",
       R"sql(
-- A serving result's load points (TrialResult.serving; the SLO search's probes are not rows):
-- what `best` ranks for a serving metric, within one (model, sm, model identity, workload,
-- load point) and never against result_batches, whose lockstep rows no serving result has.
CREATE TABLE serving_points (
  result_id               INTEGER NOT NULL REFERENCES results(result_id) ON DELETE CASCADE,
  point_index             INTEGER NOT NULL,  -- its place in the result's serving list
  sweep_id                INTEGER NOT NULL,
  model                   TEXT    NOT NULL,
  sm                      INTEGER NOT NULL,
  model_key               TEXT    NOT NULL,  -- '' when unknown
  workload                TEXT    NOT NULL,  -- ServeWorkloadKey
  load_point              TEXT    NOT NULL,  -- LoadPointName: 'concurrency=4', 'rate=2'
  mode                    TEXT    NOT NULL CHECK (mode IN ('closed_loop', 'poisson')),
  concurrency             INTEGER NOT NULL,  -- closed loop: in flight; poisson: the cap (0: none)
  request_rate            REAL,              -- poisson: requests/s
  verdict                 TEXT    NOT NULL,  -- the point's: OK or INCORRECT
  ok                      INTEGER NOT NULL,  -- the result is OK (so is every one of its points)
  completed               INTEGER NOT NULL,
  duration_s              REAL    NOT NULL,
  request_throughput      REAL    NOT NULL,
  output_throughput       REAL    NOT NULL,  -- output tok/s
  total_token_throughput  REAL    NOT NULL,
  output_tok_s_per_user   REAL    NOT NULL,
  median_ttft_ms          REAL    NOT NULL,
  p99_ttft_ms             REAL    NOT NULL,
  median_tpot_ms          REAL    NOT NULL,
  p99_tpot_ms             REAL    NOT NULL,
  p99_itl_ms              REAL    NOT NULL,
  p99_e2el_ms             REAL    NOT NULL,
  request_goodput         REAL,              -- with the workload's SLO
  meets_slo               INTEGER,           -- with the workload's SLO
  finished_ms             INTEGER NOT NULL,
  PRIMARY KEY (result_id, point_index)
);
CREATE INDEX serving_points_best ON serving_points(model, sm, ok, load_point, model_key,
                                                   workload);
CREATE INDEX serving_points_sweep ON serving_points(sweep_id);
)sql"},
      {"results.result_digest: the content of an agent's result, so that a duplicate with other "
       "content is refused",
       R"sql(
-- The first 16 bytes of the SHA-256 of the canonical JSON of the result as the agent sent it
-- (api/digest.h); NULL for results stored before it existed and for results the coordinator
-- made itself.
ALTER TABLE results ADD COLUMN result_digest BLOB;
)sql"},
  };
  return migrations;
}

absl::StatusOr<int> SchemaVersion(sqlite3* db) {
  sqlite3_stmt* stmt = nullptr;
  int rc = sqlite3_prepare_v2(db, "PRAGMA user_version", -1, &stmt, nullptr);
  if (rc != SQLITE_OK) return SqliteError(db, rc, "reading the schema version");
  rc = sqlite3_step(stmt);
  if (rc != SQLITE_ROW) {
    absl::Status s = SqliteError(db, rc, "reading the schema version");
    sqlite3_finalize(stmt);
    return s;
  }
  const int version = sqlite3_column_int(stmt, 0);
  sqlite3_finalize(stmt);
  return version;
}

namespace {

// FailedPrecondition naming the first row that breaks a foreign key, if any.
absl::Status CheckForeignKeys(sqlite3* db, const std::string& op) {
  sqlite3_stmt* stmt = nullptr;
  int rc = sqlite3_prepare_v2(db, "PRAGMA foreign_key_check", -1, &stmt, nullptr);
  if (rc != SQLITE_OK) return SqliteError(db, rc, op);
  rc = sqlite3_step(stmt);
  absl::Status s = absl::OkStatus();
  if (rc == SQLITE_ROW) {
    auto text = [stmt](int col) {
      const unsigned char* t = sqlite3_column_text(stmt, col);
      return t != nullptr ? std::string(reinterpret_cast<const char*>(t)) : std::string("?");
    };
    s = absl::FailedPreconditionError(absl::StrCat(op, ": a row of ", text(0), " (rowid ", text(1),
                                                   ") references a missing row of ", text(2)));
  } else if (rc != SQLITE_DONE) {
    s = SqliteError(db, rc, op);
  }
  sqlite3_finalize(stmt);
  return s;
}

}  // namespace

absl::Status Migrate(sqlite3* db) {
  ASSIGN_OR_RETURN(const int version, SchemaVersion(db));
  const int latest = LatestSchemaVersion();
  if (version > latest)
    return absl::FailedPreconditionError(
        absl::StrCat("database schema version ", version, " is newer than this build supports (",
                     latest, "); use a newer infersweep or another database file"));
  if (version == latest) return absl::OkStatus();
  // A step may rebuild a table that others reference (CREATE, copy, DROP, RENAME): SQLite asks
  // for foreign keys off meanwhile (the pragma is a no-op inside a transaction) and a
  // foreign_key_check before the commit.
  RETURN_IF_ERROR(ExecSql(db, "PRAGMA foreign_keys = OFF", "migrating the schema"));
  absl::Status result = absl::OkStatus();
  for (int v = version; v < latest && result.ok(); ++v) {
    const std::string op = absl::StrCat("migrating the schema from version ", v, " to ", v + 1,
                                        " (", Migrations()[v].description, ")");
    if (absl::Status s = ExecSql(db, "BEGIN IMMEDIATE", op); !s.ok()) {
      result = s;
      break;
    }
    // PRAGMA takes no bound parameters; the version is this build's own constant.
    const std::string sql =
        absl::StrCat(Migrations()[v].sql, "\nPRAGMA user_version = ", v + 1, ";");
    absl::Status s = ExecSql(db, sql.c_str(), op);
    if (s.ok()) s = CheckForeignKeys(db, op);
    if (s.ok()) s = ExecSql(db, "COMMIT", op);
    if (!s.ok()) {
      if (!sqlite3_get_autocommit(db)) sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
      result = s;
    }
  }
  if (absl::Status s = ExecSql(db, "PRAGMA foreign_keys = ON", "migrating the schema");
      result.ok() && !s.ok())
    result = s;
  return result;
}

}  // namespace infersweep
