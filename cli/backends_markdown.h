// The backend registry as documentation: docs/BACKENDS.md is this output, checked in, and
// tests/backends_doc_test.cc fails when the two differ.
#pragma once

#include <string>
#include <vector>

#include "api/backend_config.h"

namespace infersweep::cli {

// The whole of docs/BACKENDS.md: fixed prose around one table row per (axis, value) of
// `registry`, and the defaults of DefaultAxes for each device the registry names.
std::string BackendsMarkdown(const std::vector<BackendDescriptor>& registry = BackendRegistry());

// One line per (axis, value): "axis=value  device  sm  precision  description", for a terminal.
std::string BackendsText(const std::vector<BackendDescriptor>& registry = BackendRegistry());

}  // namespace infersweep::cli
