// The `selector:` section of a sweep spec: which agents may run its trials. gpu_name is a regex
// from the user, compiled bounded (api/untrusted_regex.h).
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "api/untrusted_regex.h"
#include "coordinator/sweep_spec_internal.h"

namespace infersweep::sweep_spec_internal {
namespace {

constexpr const char* kSelectorKeys[] = {"sm", "gpu_name", "min_memory_gb", "gpus", "p2p"};

}  // namespace

absl::Status ParseSelectorNode(const Parser& p, const Entry& e, Selector* s) {
  ASSIGN_OR_RETURN(std::vector<Entry> kv, p.MapEntries(e.value, "selector"));
  for (const Entry& f : kv) {
    const std::string field = absl::StrCat("selector.", f.key);
    if (f.key == "sm") {
      ASSIGN_OR_RETURN(std::vector<int64_t> sms, p.IntList(f.value, field, 1, 1000, 64));
      s->sm_archs.assign(sms.begin(), sms.end());
    } else if (f.key == "gpu_name") {
      ASSIGN_OR_RETURN(s->gpu_name_regex, p.Text(f.value, field));
      // RE2, bounded: a pattern is untrusted input and must not cost the coordinator its stack
      // or its memory (api/untrusted_regex.h).
      if (auto re = CompileUntrustedRegex(s->gpu_name_regex); !re.ok())
        return p.Error(f.value, field, re.status().message());
    } else if (f.key == "min_memory_gb") {
      ASSIGN_OR_RETURN(double gb, p.Number(f.value, field, 0, 1e6));
      s->min_memory_bytes = static_cast<int64_t>(std::llround(gb * 1e9));
    } else if (f.key == "gpus") {
      ASSIGN_OR_RETURN(s->gpus_needed, p.Int(f.value, field, 1, 64));
    } else if (f.key == "p2p") {
      ASSIGN_OR_RETURN(s->needs_p2p, p.Bool(f.value, field));
    } else if (f.key == "device") {
      return p.Error(f.key_node, field,
                     "not a selector key: each trial's device follows its config (matrix axis "
                     "'device' or the top-level 'device:')");
    } else {
      return p.Error(
          f.key_node, "selector",
          absl::StrCat("unknown key '", f.key, "' (known: ", KnownKeys(kSelectorKeys), ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace infersweep::sweep_spec_internal
