// TEST ONLY knobs of graphs=persistent, kept off its hot path: the fault injection it takes
// per layer, and the profiling timeline (INFERSWEEP_PERSISTENT_TIMELINE=<file>: each block's
// stamps of one batch-1 decode step, written as a table of where a layer's time goes).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "engine/fault_injection.h"
#include "kernels/cuda/sm90a/decode_persistent.h"

namespace infersweep {

// The TEST ONLY faults (bad-scale, zero-expert, nan-layer) as layer `layer`'s table shows them.
void ApplyPersistentFaults(const FaultInjection& fault, int layer, cuda::PersistentLayer& p);

// The timeline's file (INFERSWEEP_PERSISTENT_TIMELINE), or null when none is asked for.
const char* PersistentTimelinePath();
// Bytes of the stamps of a model of `layers` layers, one row of events per block.
size_t PersistentTimelineBytes(int layers);

// After a batch-1 decode step: reads the step's stamps (args.timeline), writes their table to
// `path`, and zeroes them for the next step.
void ReportPersistentTimeline(const cuda::PersistentDecodeArgs& args, int layers,
                              const std::string& path);

// The table of one step's stamps `t` ([blocks, PersistentTimelineEvents(layers)]).
void WritePersistentTimeline(const std::string& path, const std::vector<unsigned long long>& t,
                             int blocks, int layers, int ring_bytes);

}  // namespace infersweep
