// Subcommands of the `infersweep` binary, grouped by the module they drive.
#pragma once

#include <CLI/CLI.hpp>

namespace infersweep::cli {

// logits, generate, demo: the engine's command-line contract (docs/CLI.md); backends: the
// registry, and with --markdown docs/BACKENDS.md.
void AddEngineCommands(CLI::App& app);
// run (trials in isolated workers) and the hidden worker.
void AddRunCommands(CLI::App& app);
// The fleet service (docs/SERVICE.md). coordinator and agent: its daemons.
void AddDaemonCommands(CLI::App& app);
// submit, status, cancel: sweeps and their progress.
void AddSweepCommands(CLI::App& app);
// results, best, compare, agents: what a coordinator has stored and knows.
void AddQueryCommands(CLI::App& app);
// allreduce-bench: the CPU ranks' all-reduce, nccl-tests style.
void AddParallelCommands(CLI::App& app);
// regressions: the stored history judged with a noise-aware test (docs/OBSERVABILITY.md).
void AddObservabilityCommands(CLI::App& app);

}  // namespace infersweep::cli
