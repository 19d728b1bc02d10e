// Human-readable results in the nccl-tests manner: '#' lines for context, one row per
// (config, batch) with units in the column names and the verdict in the row.
#pragma once

#include <string>
#include <vector>

#include "api/trial.h"

namespace infersweep {

std::string FormatReportHeader(const std::vector<std::string>& context_lines);
std::string FormatResultRows(const TrialResult& result);
std::string FormatColumnHeader();

// What ran at one batch size (BatchFigures::prefill_kernels, decode_kernels) as '#' lines: per
// phase a line naming it (CUDA graph replay or not, launches in the step), one line per kernel
// or op ("count  name", in first-launch order), one per fallback. For `run --show-kernels` and
// `results --show-kernels`.
std::string FormatKernels(const BatchFigures& figures);

// How what ran differs between two results at one batch size, one sentence a difference,
// `a_name` and `b_name` naming the sides: a phase recorded on one side only, a CUDA graph replay
// on one side only, kernels run on one side only (with their counts), kernels run on both with
// different counts, fallbacks taken on one side only. Kernels compare by name and count, not by
// launch order. Empty when they ran the same.
std::vector<std::string> KernelDifferences(const BatchFigures& a, const BatchFigures& b,
                                           const std::string& a_name = "A",
                                           const std::string& b_name = "B");
// Whether both recorded both phases and ran the same kernels with the same counts, graph replay
// and fallbacks (KernelDifferences is empty). Results without a launch log are never the same.
bool SameKernels(const BatchFigures& a, const BatchFigures& b);

}  // namespace infersweep
