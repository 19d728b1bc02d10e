#include <CLI/CLI.hpp>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"infersweep: find which inference backends work on a GPU, and which are fastest"};
  app.require_subcommand(1);
  infersweep::cli::AddEngineCommands(app);
  infersweep::cli::AddRunCommands(app);
  infersweep::cli::AddDaemonCommands(app);
  infersweep::cli::AddSweepCommands(app);
  infersweep::cli::AddQueryCommands(app);
  infersweep::cli::AddObservabilityCommands(app);
  infersweep::cli::AddParallelCommands(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
