// libopapi: one operator call sent to the server (the generated aclnn_ops.cpp uses this).
#pragma once

#include "aclnn/aclnn_base.h"
#include "remote.h"

namespace aclnn_remote {

// The parameters of one aclnnXGetWorkspaceSize, by their CANN names; a null pointer is an absent one.
class OpCall {
public:
    explicit OpCall(const char *op);
    void tensor(const char *name, const aclTensor *tensor);
    void int_array(const char *name, const aclIntArray *array);
    void bool_array(const char *name, const aclBoolArray *array);
    void boolean(const char *name, bool value);
    void integer(const char *name, int64_t value);
    void real(const char *name, double value);
    // Validates and plans on the server; the server's workspace is its own, so *workspaceSize is 0.
    aclnnStatus plan(uint64_t *workspaceSize, aclOpExecutor **executor);

private:
    aclnn::v1::OpCall call_;
    int status_ = ACLNN_SUCCESS;  // the first parameter refused here (a pointer that is not device memory)
    std::string message_;
};

// aclnnX: queues the planned call on the stream (a single-use executor is gone afterwards).
aclnnStatus launch(const char *op, aclOpExecutor *executor, aclrtStream stream);

}  // namespace aclnn_remote
