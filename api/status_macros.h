// Early returns on absl::Status / absl::StatusOr, shared by every library.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns the status of `expr` when it is not OK.
#define RETURN_IF_ERROR(expr)                                       \
  do {                                                              \
    if (absl::Status status_macro_ = (expr); !status_macro_.ok()) { \
      return status_macro_;                                         \
    }                                                               \
  } while (0)

// Declares or assigns `lhs` from the value of a StatusOr `expr`, or returns its status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  INFERSWEEP_ASSIGN_OR_RETURN_IMPL(INFERSWEEP_STATUS_CONCAT(status_or_, __LINE__), lhs, expr)

#define INFERSWEEP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return std::move(tmp).status();         \
  lhs = std::move(*tmp)
#define INFERSWEEP_STATUS_CONCAT_INNER(a, b) a##b
#define INFERSWEEP_STATUS_CONCAT(a, b) INFERSWEEP_STATUS_CONCAT_INNER(a, b)
