// libopapi: the operators' two phases over the server's GetWorkspaceSize and Execute.
#include "ops.h"

#include <new>

#include "objects.h"

namespace aclnn_remote {
namespace {

// The executors planned and not yet consumed by their single launch or destroyed.
Registry<> live_executors;

bool live(aclOpExecutor *executor) { return live_executors.find(executor).has_value(); }

// Forgets and frees an executor, unless another thread ended it first.
void retire(aclOpExecutor *executor)
{
    if (live_executors.remove(executor)) delete executor;
}

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
    auto *planned = new (std::nothrow) aclOpExecutor;
    if (!planned) return fail(ACLNN_ERR_INNER, "out of host memory");
    planned->op = call_.op();
    planned->id = reply.executor();
    live_executors.add(planned);
    *workspaceSize = 0;
    *executor = planned;
    return ACLNN_SUCCESS;
}

aclnnStatus launch(const char *op, aclOpExecutor *executor, aclrtStream stream)
{
    if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor: is null");
    if (!live(executor)) return fail(ACLNN_ERR_PARAM_INVALID, kNotLive);
    if (executor->op != op) return fail(ACLNN_ERR_PARAM_INVALID, "executor: was planned for " + executor->op);
    int64_t on = stream_id(stream);
    if (on < 0) return fail(ACLNN_ERR_PARAM_INVALID, "stream: not a live stream (from aclrtCreateStream)");
    aclnn::v1::ExecuteRequest request;
    request.set_executor(executor->id);
    aclnn::v1::ExecuteResponse reply;
    grpc::Status status = stub().Execute(context(on).get(), request, &reply);
    if (!executor->repeatable) retire(executor);  // single use: the launch consumed it
    return status.ok() ? ACLNN_SUCCESS : rpc_failure(status);
}

}  // namespace aclnn_remote

extern "C" {

aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor)
{
    using namespace aclnn_remote;
    if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor: is null");
    if (!live(executor)) return fail(ACLNN_ERR_PARAM_INVALID, kNotLive);
    aclnn::v1::ExecutorRef request;
    request.set_executor(executor->id);
    aclnn::v1::Empty reply;
    grpc::Status status = stub().SetExecutorRepeatable(context().get(), request, &reply);
    if (!status.ok()) return rpc_failure(status);
    executor->repeatable = true;
    return ACLNN_SUCCESS;
}

aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor)
{
    using namespace aclnn_remote;
    if (!executor) return fail(ACLNN_ERR_PARAM_NULLPTR, "executor: is null");
    if (!live(executor)) return fail(ACLNN_ERR_PARAM_INVALID, kNotLive);
    aclnn::v1::ExecutorRef request;
    request.set_executor(executor->id);
    aclnn::v1::Empty reply;
    grpc::Status status = stub().DestroyExecutor(context().get(), request, &reply);
    retire(executor);
    return status.ok() ? ACLNN_SUCCESS : rpc_failure(status);
}

}  // extern "C"
