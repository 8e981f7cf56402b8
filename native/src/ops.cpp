// libopapi: the operators' two phases over the server's GetWorkspaceSize and Execute.
#include "ops.h"

#include <atomic>
#include <memory>

#include "objects.h"

namespace aclnn_remote {
namespace {

// A planned call on the server: its executor id there.
struct Executor {
    std::string op;
    std::string id;
    std::atomic<bool> repeatable{false};
};

// The executors planned and not yet consumed by their single launch or destroyed, by handle (new_handle:
// a stale one never names a newer executor). A call holds its executor while it uses it.
Registry<std::shared_ptr<Executor>> &live_executors = *new Registry<std::shared_ptr<Executor>>;  // never destroyed

std::shared_ptr<Executor> live(aclOpExecutor *executor) { return live_executors.find(executor).value_or(nullptr); }

void retire(aclOpExecutor *executor) { live_executors.remove(executor); }

const char *const kNotLive = "executor: not a live executor (a single-use one is consumed by its launch)";

}  // namespace

OpCall::OpCall(const char *op) { call_.set_op(op); }

void OpCall::tensor(const char *name, const aclTensor *tensor)
{
    if (!tensor) return;  // absent: a null pointer to the server
    aclnn::v1::Tensor *message = (*call_.mutable_params())[name].mutable_tensor();
    message->set_data_type(tensor->data_type);
    message->set_format(tensor->format);
    for (int64_t d : tensor->view_dims) message->add_view_dims(d);
    for (int64_t s : tensor->strides) message->add_strides(s);
    message->set_offset(tensor->offset);
    for (int64_t d : tensor->storage_dims) message->add_storage_dims(d);
    DeviceRef ref;
    if (tensor->data && resolve(tensor->data, &ref)) {
        message->mutable_ref()->mutable_device()->set_buffer(ref.buffer);
        message->mutable_ref()->mutable_device()->set_offset(ref.offset);
        return;
    }
    bool empty = false;
    for (int64_t d : tensor->storage_dims) empty = empty || d == 0;
    if (!tensor->data && empty) {
        message->set_data("");  // no storage, no memory needed
    } else if (status_ == ACLNN_SUCCESS) {
        status_ = ACLNN_ERR_PARAM_INVALID;
        message_ = std::string(name) + ": " +
                   (tensor->data ? "tensor data is not device memory (a pointer from aclrtMalloc)"
                                 : "tensor data is null but its storage is not empty");
    }
}

void OpCall::int_array(const char *name, const aclIntArray *array)
{
    if (!array) return;
    auto *values = (*call_.mutable_params())[name].mutable_int_array();
    for (int64_t v : array->values) values->add_values(v);
}

void OpCall::bool_array(const char *name, const aclBoolArray *array)
{
    if (!array) return;
    auto *values = (*call_.mutable_params())[name].mutable_bool_array();
    for (bool v : array->values) values->add_values(v);
}

void OpCall::boolean(const char *name, bool value) { (*call_.mutable_params())[name].set_bool_value(value); }

void OpCall::integer(const char *name, int64_t value) { (*call_.mutable_params())[name].set_int_value(value); }

void OpCall::real(const char *name, double value) { (*call_.mutable_params())[name].set_double_value(value); }

aclnnStatus OpCall::plan(uint64_t *workspaceSize, aclOpExecutor **executor)
{
    if (status_ != ACLNN_SUCCESS) return fail(status_, message_);
    if (!workspaceSize) return fail(ACLNN_ERR_PARAM_NULLPTR, "workspaceSize: is null");
    if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor: is null");
    aclnn::v1::WorkspacePlan reply;
    grpc::Status status = stub().GetWorkspaceSize(context().get(), call_, &reply);
    if (!status.ok()) return rpc_failure(status);
    auto *handle = static_cast<aclOpExecutor *>(new_handle());
    if (!handle) return fail(ACLNN_ERR_INNER, "no executor handle left in this process");
    auto planned = std::make_shared<Executor>();
    planned->op = call_.op();
    planned->id = reply.executor();
    live_executors.add(handle, planned);
    *workspaceSize = 0;
    *executor = handle;
    return ACLNN_SUCCESS;
}

aclnnStatus launch(const char *op, aclOpExecutor *executor, aclrtStream stream)
{
    if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor: is null");
    std::shared_ptr<Executor> planned = live(executor);
    if (!planned) return fail(ACLNN_ERR_PARAM_INVALID, kNotLive);
    if (planned->op != op) return fail(ACLNN_ERR_PARAM_INVALID, "executor: was planned for " + planned->op);
    int64_t on = stream_id(stream);
    if (on < 0) return fail(ACLNN_ERR_PARAM_INVALID, "stream: not a live stream (from aclrtCreateStream)");
    aclnn::v1::ExecuteRequest request;
    request.set_executor(planned->id);
    aclnn::v1::ExecuteResponse reply;
    grpc::Status status = stub().Execute(context(on).get(), request, &reply);
    if (!planned->repeatable) retire(executor);  // single use: the launch consumed it
    if (!status.ok()) return rpc_failure(status);
    launched(on);
    return ACLNN_SUCCESS;
}

}  // namespace aclnn_remote

extern "C" {

aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor)
{
    using namespace aclnn_remote;
    if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor: is null");
    std::shared_ptr<Executor> planned = live(executor);
    if (!planned) return fail(ACLNN_ERR_PARAM_INVALID, kNotLive);
    aclnn::v1::ExecutorRef request;
    request.set_executor(planned->id);
    aclnn::v1::Empty reply;
    grpc::Status status = stub().SetExecutorRepeatable(context().get(), request, &reply);
    if (!status.ok()) return rpc_failure(status);
    planned->repeatable = true;
    return ACLNN_SUCCESS;
}

aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor)
{
    using namespace aclnn_remote;
    if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor: is null");
    std::shared_ptr<Executor> planned = live(executor);
    if (!planned) return fail(ACLNN_ERR_PARAM_INVALID, kNotLive);
    aclnn::v1::ExecutorRef request;
    request.set_executor(planned->id);
    aclnn::v1::Empty reply;
    grpc::Status status = stub().DestroyExecutor(context().get(), request, &reply);
    retire(executor);
    return status.ok() ? ACLNN_SUCCESS : rpc_failure(status);
}

}  // extern "C"
