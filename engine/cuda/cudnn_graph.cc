#include "engine/cuda/cudnn_graph.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"
#include "api/status_macros.h"
#include "engine/cudnn_loader.h"
#include "kernels/cuda/check.h"

namespace infersweep::cudnn {

struct Api {
  cudnnStatus_t (*create)(cudnnHandle_t*);
  cudnnStatus_t (*destroy)(cudnnHandle_t);
  cudnnStatus_t (*set_stream)(cudnnHandle_t, cudaStream_t);
  const char* (*error_string)(cudnnStatus_t);
  void (*last_error)(char*, size_t);
  cudnnStatus_t (*create_descriptor)(cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t*);
  cudnnStatus_t (*destroy_descriptor)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*finalize)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*set_attribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                 cudnnBackendAttributeType_t, int64_t, const void*);
  cudnnStatus_t (*get_attribute)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                 cudnnBackendAttributeType_t, int64_t, int64_t*, void*);
  cudnnStatus_t (*execute)(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t);
};

namespace {

template <typename F>
bool Bind(void* library, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(library, name));
  return *out != nullptr;
}

// cuDNN's last error message for this thread ("" when it has none).
std::string LastError(const Api* api) {
  char message[1024] = {0};
  api->last_error(message, sizeof(message));
  return message;
}

}  // namespace

absl::StatusOr<const Api*> LoadApi(size_t min_version) {
  absl::StatusOr<const CudnnLibrary*> library = ProcessCudnn();
  RETURN_IF_ERROR(RequireCudnn(library, min_version, "cuDNN's graph API"));
  static const absl::StatusOr<Api>* api = [](void* handle) {
    Api a{};
    const char* missing = nullptr;
    auto bind = [&](const char* name, auto* out) {
      if (!Bind(handle, name, out) && missing == nullptr) missing = name;
    };
    bind("cudnnCreate", &a.create);
    bind("cudnnDestroy", &a.destroy);
    bind("cudnnSetStream", &a.set_stream);
    bind("cudnnGetErrorString", &a.error_string);
    bind("cudnnGetLastErrorString", &a.last_error);
    bind("cudnnBackendCreateDescriptor", &a.create_descriptor);
    bind("cudnnBackendDestroyDescriptor", &a.destroy_descriptor);
    bind("cudnnBackendFinalize", &a.finalize);
    bind("cudnnBackendSetAttribute", &a.set_attribute);
    bind("cudnnBackendGetAttribute", &a.get_attribute);
    bind("cudnnBackendExecute", &a.execute);
    if (missing != nullptr)
      return new absl::StatusOr<Api>(
          absl::UnimplementedError(absl::StrCat("cuDNN has no ", missing)));
    return new absl::StatusOr<Api>(a);
  }((*library)->handle);
  if (!api->ok()) return api->status();
  return &**api;
}

Descriptor& Descriptor::operator=(Descriptor&& other) noexcept {
  if (this != &other) {
    if (raw_ != nullptr) api_->destroy_descriptor(raw_);
    api_ = other.api_;
    raw_ = other.raw_;
    other.raw_ = nullptr;
  }
  return *this;
}

Descriptor::~Descriptor() {
  if (raw_ != nullptr) api_->destroy_descriptor(raw_);
}

absl::StatusOr<std::unique_ptr<Handle>> Handle::Create(const Api* api, cudaStream_t stream) {
  cudnnHandle_t raw = nullptr;
  if (cudnnStatus_t s = api->create(&raw); s != CUDNN_STATUS_SUCCESS)
    return absl::UnavailableError(
        absl::StrCat("cudnnCreate: ", api->error_string(s), " ", LastError(api)));
  std::unique_ptr<Handle> handle(new Handle(api, raw));
  if (cudnnStatus_t s = api->set_stream(raw, stream); s != CUDNN_STATUS_SUCCESS)
    return absl::InternalError(absl::StrCat("cudnnSetStream: ", api->error_string(s)));
  return handle;
}

Handle::~Handle() { api_->destroy(raw_); }

absl::Status Handle::SetStream(cudaStream_t stream) const {
  if (cudnnStatus_t s = api_->set_stream(raw_, stream); s != CUDNN_STATUS_SUCCESS)
    return absl::InternalError(absl::StrCat("cudnnSetStream: ", api_->error_string(s)));
  return absl::OkStatus();
}

std::vector<int64_t> PackedStrides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i)
    strides[i] = strides[i + 1] * dims[i + 1];
  return strides;
}

absl::Status GraphBuilder::Check(cudnnStatus_t status, const char* step) const {
  if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
  const std::string why = LastError(api_);
  // NOT_SUPPORTED (3000s): this cuDNN or this GPU does not take the graph; the rest are
  // mistakes in the graph or the library failing.
  const bool unsupported = status / 1000 == 3;
  const std::string message = absl::StrCat(step, ": ", api_->error_string(status),
                                           why.empty() ? "" : " (", why, why.empty() ? "" : ")");
  return unsupported ? absl::UnimplementedError(message) : absl::InternalError(message);
}

absl::StatusOr<Descriptor> GraphBuilder::Make(cudnnBackendDescriptorType_t type,
                                              const char* step) const {
  cudnnBackendDescriptor_t raw = nullptr;
  RETURN_IF_ERROR(Check(api_->create_descriptor(type, &raw), step));
  return Descriptor(api_, raw);
}

absl::StatusOr<int> GraphBuilder::Tensor(const TensorSpec& spec) {
  ASSIGN_OR_RETURN(Descriptor d, Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor"));
  const int64_t rank = static_cast<int64_t>(spec.dims.size()), alignment = 16;
  auto set = [&](cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t n,
                 const void* value) { return api_->set_attribute(d.raw(), name, type, n, value); };
  cudnnStatus_t s = set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &spec.type);
  if (s == CUDNN_STATUS_SUCCESS)
    s = set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, rank, spec.dims.data());
  if (s == CUDNN_STATUS_SUCCESS)
    s = set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, rank, spec.strides.data());
  if (s == CUDNN_STATUS_SUCCESS)
    s = set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &spec.uid);
  if (s == CUDNN_STATUS_SUCCESS)
    s = set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  if (s == CUDNN_STATUS_SUCCESS && spec.is_virtual) {
    const bool yes = true;
    s = set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
  }
  if (s == CUDNN_STATUS_SUCCESS && spec.by_value) {
    const bool yes = true;
    s = set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
  }
  if (s == CUDNN_STATUS_SUCCESS && spec.reordering != CUDNN_TENSOR_REORDERING_NONE)
    s = set(CUDNN_ATTR_TENSOR_REORDERING_MODE, CUDNN_TYPE_TENSOR_REORDERING_MODE, 1,
            &spec.reordering);
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(d.raw());
  const std::string step = absl::StrCat("tensor ", spec.uid);
  RETURN_IF_ERROR(Check(s, step.c_str()));
  tensors_.push_back(std::move(d));
  return static_cast<int>(tensors_.size()) - 1;
}

absl::Status GraphBuilder::Matmul(int a, int b, int c, int m_override, int n_override,
                                  int k_override, bool padded) {
  ASSIGN_OR_RETURN(Descriptor desc, Make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul"));
  const cudnnDataType_t math = CUDNN_DATA_FLOAT;
  cudnnStatus_t s =
      api_->set_attribute(desc.raw(), CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &math);
  if (s == CUDNN_STATUS_SUCCESS && padded) {
    const double padding = 0.0;
    s = api_->set_attribute(desc.raw(), CUDNN_ATTR_MATMUL_PADDING_VALUE, CUDNN_TYPE_DOUBLE, 1,
                            &padding);
  }
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(desc.raw());
  RETURN_IF_ERROR(Check(s, "matmul descriptor"));
  ASSIGN_OR_RETURN(Descriptor op, Make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul op"));
  auto bind = [&](cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    return api_->set_attribute(op.raw(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
  };
  s = bind(CUDNN_ATTR_OPERATION_MATMUL_ADESC, tensors_[a].raw());
  if (s == CUDNN_STATUS_SUCCESS) s = bind(CUDNN_ATTR_OPERATION_MATMUL_BDESC, tensors_[b].raw());
  if (s == CUDNN_STATUS_SUCCESS) s = bind(CUDNN_ATTR_OPERATION_MATMUL_CDESC, tensors_[c].raw());
  if (s == CUDNN_STATUS_SUCCESS) s = bind(CUDNN_ATTR_OPERATION_MATMUL_DESC, desc.raw());
  if (s == CUDNN_STATUS_SUCCESS && m_override >= 0)
    s = bind(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, tensors_[m_override].raw());
  if (s == CUDNN_STATUS_SUCCESS && n_override >= 0)
    s = bind(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, tensors_[n_override].raw());
  if (s == CUDNN_STATUS_SUCCESS && k_override >= 0)
    s = bind(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, tensors_[k_override].raw());
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(op.raw());
  RETURN_IF_ERROR(Check(s, "matmul operation"));
  helpers_.push_back(std::move(desc));
  operations_.push_back(std::move(op));
  return absl::OkStatus();
}

absl::Status GraphBuilder::Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, int x, int y,
                                     int b, int t, int64_t axis) {
  ASSIGN_OR_RETURN(Descriptor desc, Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise"));
  cudnnStatus_t s = api_->set_attribute(desc.raw(), CUDNN_ATTR_POINTWISE_MODE,
                                        CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
  if (s == CUDNN_STATUS_SUCCESS)
    s = api_->set_attribute(desc.raw(), CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1,
                            &math);
  if (s == CUDNN_STATUS_SUCCESS && axis >= 0)
    s = api_->set_attribute(desc.raw(), CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(desc.raw());
  RETURN_IF_ERROR(Check(s, "pointwise descriptor"));
  ASSIGN_OR_RETURN(Descriptor op, Make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pw op"));
  auto bind = [&](cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    return api_->set_attribute(op.raw(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
  };
  s = bind(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, desc.raw());
  if (s == CUDNN_STATUS_SUCCESS) s = bind(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, tensors_[x].raw());
  if (s == CUDNN_STATUS_SUCCESS && b >= 0)
    s = bind(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, tensors_[b].raw());
  if (s == CUDNN_STATUS_SUCCESS && t >= 0)
    s = bind(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, tensors_[t].raw());
  if (s == CUDNN_STATUS_SUCCESS) s = bind(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, tensors_[y].raw());
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(op.raw());
  const std::string step = absl::StrCat("pointwise operation (mode ", static_cast<int>(mode), ")");
  RETURN_IF_ERROR(Check(s, step.c_str()));
  helpers_.push_back(std::move(desc));
  operations_.push_back(std::move(op));
  return absl::OkStatus();
}

absl::Status GraphBuilder::Reduction(cudnnReduceTensorOp_t op_kind, int x, int y) {
  ASSIGN_OR_RETURN(Descriptor desc, Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction"));
  const cudnnDataType_t math = CUDNN_DATA_FLOAT;
  cudnnStatus_t s = api_->set_attribute(desc.raw(), CUDNN_ATTR_REDUCTION_OPERATOR,
                                        CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &op_kind);
  if (s == CUDNN_STATUS_SUCCESS)
    s = api_->set_attribute(desc.raw(), CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1,
                            &math);
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(desc.raw());
  RETURN_IF_ERROR(Check(s, "reduction descriptor"));
  ASSIGN_OR_RETURN(Descriptor op, Make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "red op"));
  auto bind = [&](cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    return api_->set_attribute(op.raw(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
  };
  s = bind(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, tensors_[x].raw());
  if (s == CUDNN_STATUS_SUCCESS) s = bind(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, tensors_[y].raw());
  if (s == CUDNN_STATUS_SUCCESS) s = bind(CUDNN_ATTR_OPERATION_REDUCTION_DESC, desc.raw());
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(op.raw());
  RETURN_IF_ERROR(Check(s, "reduction operation"));
  helpers_.push_back(std::move(desc));
  operations_.push_back(std::move(op));
  return absl::OkStatus();
}

absl::Status GraphBuilder::BlockScaleDequantize(int x, int scale, int y,
                                                const std::vector<int32_t>& block) {
  ASSIGN_OR_RETURN(Descriptor op, Make(CUDNN_BACKEND_OPERATION_BLOCK_SCALE_DEQUANTIZE_DESCRIPTOR,
                                       "block-scale dequantize"));
  auto bind = [&](cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    return api_->set_attribute(op.raw(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
  };
  const cudnnDataType_t math = CUDNN_DATA_FLOAT;
  cudnnStatus_t s = bind(CUDNN_ATTR_OPERATION_BLOCK_SCALE_DEQUANTIZE_XDESC, tensors_[x].raw());
  if (s == CUDNN_STATUS_SUCCESS)
    s = bind(CUDNN_ATTR_OPERATION_BLOCK_SCALE_DEQUANTIZE_SCALE_DESC, tensors_[scale].raw());
  if (s == CUDNN_STATUS_SUCCESS)
    s = bind(CUDNN_ATTR_OPERATION_BLOCK_SCALE_DEQUANTIZE_YDESC, tensors_[y].raw());
  if (s == CUDNN_STATUS_SUCCESS)
    s = api_->set_attribute(op.raw(), CUDNN_ATTR_OPERATION_BLOCK_SCALE_DEQUANTIZE_MATH_PREC,
                            CUDNN_TYPE_DATA_TYPE, 1, &math);
  if (s == CUDNN_STATUS_SUCCESS)
    s = api_->set_attribute(op.raw(), CUDNN_ATTR_OPERATION_BLOCK_SCALE_DEQUANTIZE_BLOCK_SIZE,
                            CUDNN_TYPE_INT32, static_cast<int64_t>(block.size()), block.data());
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(op.raw());
  RETURN_IF_ERROR(Check(s, "block-scale dequantize operation"));
  operations_.push_back(std::move(op));
  return absl::OkStatus();
}

absl::StatusOr<Plan> GraphBuilder::Build(const std::string& what) {
  auto prefixed = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  };
  absl::StatusOr<Descriptor> graph = Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "graph");
  if (!graph.ok()) return prefixed(graph.status());
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const Descriptor& op : operations_) ops.push_back(op.raw());
  cudnnHandle_t raw_handle = handle_.raw();
  cudnnStatus_t s = api_->set_attribute(graph->raw(), CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
                                        CUDNN_TYPE_HANDLE, 1, &raw_handle);
  if (s == CUDNN_STATUS_SUCCESS)
    s = api_->set_attribute(graph->raw(), CUDNN_ATTR_OPERATIONGRAPH_OPS,
                            CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
                            ops.data());
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(graph->raw());
  if (absl::Status st = Check(s, "operation graph"); !st.ok()) return prefixed(st);

  absl::StatusOr<Descriptor> heuristics = Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
  if (!heuristics.ok()) return prefixed(heuristics.status());
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  cudnnBackendDescriptor_t raw_graph = graph->raw();
  s = api_->set_attribute(heuristics->raw(), CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
                          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw_graph);
  if (s == CUDNN_STATUS_SUCCESS)
    s = api_->set_attribute(heuristics->raw(), CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1,
                            &mode);
  if (s == CUDNN_STATUS_SUCCESS) s = api_->finalize(heuristics->raw());
  if (absl::Status st = Check(s, "heuristics"); !st.ok()) return prefixed(st);
  int64_t count = 0;
  s = api_->get_attribute(heuristics->raw(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                          CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
  if (absl::Status st = Check(s, "heuristics' result count"); !st.ok()) return prefixed(st);
  std::vector<Descriptor> configs;
  std::vector<cudnnBackendDescriptor_t> raw_configs;
  for (int64_t i = 0; i < count; ++i) {
    absl::StatusOr<Descriptor> c = Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
    if (!c.ok()) return prefixed(c.status());
    raw_configs.push_back(c->raw());
    configs.push_back(std::move(*c));
  }
  if (count > 0) {
    s = api_->get_attribute(heuristics->raw(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                            CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count, raw_configs.data());
    if (absl::Status st = Check(s, "heuristics' results"); !st.ok()) return prefixed(st);
  }
  // A plan from `config`, or cuDNN's refusal.
  auto plan_from = [&](cudnnBackendDescriptor_t config,
                       const std::string& engine) -> absl::StatusOr<Plan> {
    ASSIGN_OR_RETURN(Descriptor plan, Make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "plan"));
    cudnnStatus_t st = api_->set_attribute(plan.raw(), CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                                           CUDNN_TYPE_HANDLE, 1, &raw_handle);
    if (st == CUDNN_STATUS_SUCCESS)
      st = api_->set_attribute(plan.raw(), CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &config);
    if (st == CUDNN_STATUS_SUCCESS) st = api_->finalize(plan.raw());
    RETURN_IF_ERROR(Check(st, "execution plan"));
    Plan out;
    st = api_->get_attribute(plan.raw(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64,
                             1, nullptr, &out.workspace_bytes);
    RETURN_IF_ERROR(Check(st, "plan's workspace size"));
    out.plan = std::make_shared<Descriptor>(std::move(plan));
    out.engine = engine;
    return out;
  };
  absl::Status last = absl::UnimplementedError("no engine config");
  for (int64_t i = 0; i < count; ++i) {
    absl::StatusOr<Plan> plan =
        plan_from(raw_configs[i], absl::StrCat("heuristics' engine config ", i, " of ", count));
    if (plan.ok()) return plan;
    last = plan.status();
  }
  // Heuristics offer nothing that finalizes (count 0 where the GPU lacks what the graph needs):
  // each of cuDNN's engines is asked in turn, and the answer is the last one's own words.
  int64_t engines = 0;
  s = api_->get_attribute(graph->raw(), CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT,
                          CUDNN_TYPE_INT64, 1, nullptr, &engines);
  if (absl::Status st = Check(s, "engine count"); !st.ok()) return prefixed(st);
  for (int64_t i = 0; i < engines; ++i) {
    absl::StatusOr<Descriptor> engine = Make(CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
    if (!engine.ok()) return prefixed(engine.status());
    cudnnStatus_t st = api_->set_attribute(engine->raw(), CUDNN_ATTR_ENGINE_OPERATION_GRAPH,
                                           CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw_graph);
    if (st == CUDNN_STATUS_SUCCESS)
      st = api_->set_attribute(engine->raw(), CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1,
                               &i);
    if (st == CUDNN_STATUS_SUCCESS) st = api_->finalize(engine->raw());
    const std::string name = absl::StrCat("engine ", i, " of ", engines);
    if (absl::Status c = Check(st, name.c_str()); !c.ok()) {
      last = c;
      continue;
    }
    absl::StatusOr<Descriptor> config = Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
    if (!config.ok()) return prefixed(config.status());
    cudnnBackendDescriptor_t raw_engine = engine->raw();
    st = api_->set_attribute(config->raw(), CUDNN_ATTR_ENGINECFG_ENGINE,
                             CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw_engine);
    if (st == CUDNN_STATUS_SUCCESS) st = api_->finalize(config->raw());
    if (absl::Status c = Check(st, absl::StrCat(name, "'s config").c_str()); !c.ok()) {
      last = c;
      continue;
    }
    absl::StatusOr<Plan> plan = plan_from(config->raw(), name);
    if (plan.ok()) return plan;
    last = plan.status();
  }
  return absl::Status(last.code(), absl::StrCat(what, ": cuDNN takes the graph with none of its ",
                                                engines, " engines (heuristics offered ", count,
                                                "); the last answer: ", last.message()));
}

absl::Status Workspace::Reserve(const Plan& plan) {
  if (plan.workspace_bytes <= bytes_) return absl::OkStatus();
  bytes_ = 0;
  RETURN_IF_ERROR(
      data_.Allocate(static_cast<size_t>(plan.workspace_bytes),
                     absl::StrCat("cuDNN workspace of ", plan.workspace_bytes, " bytes")));
  bytes_ = plan.workspace_bytes;
  return absl::OkStatus();
}

absl::Status Execute(const Handle& handle, const Plan& plan, const std::vector<int64_t>& uids,
                     const std::vector<void*>& pointers, void* workspace) {
  const Api* api = handle.api();
  cudnnBackendDescriptor_t pack = nullptr;
  if (cudnnStatus_t s = api->create_descriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
      s != CUDNN_STATUS_SUCCESS)
    return absl::InternalError(absl::StrCat("variant pack: ", api->error_string(s)));
  Descriptor owned(api, pack);
  cudnnStatus_t s = api->set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                       static_cast<int64_t>(uids.size()), uids.data());
  if (s == CUDNN_STATUS_SUCCESS)
    s = api->set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                           static_cast<int64_t>(pointers.size()), pointers.data());
  if (s == CUDNN_STATUS_SUCCESS)
    s = api->set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1,
                           &workspace);
  if (s == CUDNN_STATUS_SUCCESS) s = api->finalize(pack);
  if (s == CUDNN_STATUS_SUCCESS) s = api->execute(handle.raw(), plan.plan->raw(), pack);
  if (s != CUDNN_STATUS_SUCCESS)
    return absl::InternalError(
        absl::StrCat("cudnnBackendExecute: ", api->error_string(s), " ", LastError(api)));
  return absl::OkStatus();
}

}  // namespace infersweep::cudnn
