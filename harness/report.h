// Human-readable results in the nccl-tests manner: '#' lines for context, one row per
// (config, batch) with units in the column names and the verdict in the row.
#pragma once

#include <string>
#include <vector>

#include "harness/trial.h"

namespace infersweep {

std::string FormatReportHeader(const std::vector<std::string>& context_lines);
std::string FormatResultRows(const TrialResult& result);
std::string FormatColumnHeader();

}  // namespace infersweep
