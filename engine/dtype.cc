#include "engine/dtype.h"

namespace infersweep {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E8M0:
      return "F8_E8M0";
    case DType::kU8:
      return "U8";
    case DType::kI8:
      return "I8";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kBool:
      return "BOOL";
  }
  return "?";
}

std::optional<DType> DTypeFromSafetensorsName(std::string_view name) {
  // Exact, case-sensitive match: the safetensors format only spells them in upper case.
  static constexpr DType kAll[] = {DType::kF32,    DType::kF16, DType::kBF16,
                                   DType::kF8E4M3, DType::kF8E8M0, DType::kU8,
                                   DType::kI8,     DType::kI32, DType::kI64,
                                   DType::kBool};
  for (DType t : kAll) {
    if (DTypeName(t) == name) return t;
  }
  return std::nullopt;
}

}  // namespace infersweep
