// The connection to aclnn-serve (libascendcl), shared by the operators (libopapi).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "aclnn/v1/aclnn.grpc.pb.h"

namespace aclnn_remote {

// Where device memory lives on the server: a buffer id and a byte offset into it.
struct DeviceRef {
    std::string buffer;
    uint64_t offset = 0;
    uint64_t available = 0;  // bytes from the pointer to the end of its allocation
};

// The server's stub (thread-safe) and this process's session.
aclnn::v1::Aclnn::Stub &stub();

// A context carrying the session, the token and (>= 0) the stream.
std::unique_ptr<grpc::ClientContext> context(int64_t stream = -1);

// The client stream id of an aclrtStream: 0 for the default stream (null), -1 for a handle that is not
// a live stream (destroyed, or never made by aclrtCreateStream).
int64_t stream_id(void *stream);

// Resolves a pointer into device memory; false when it is not inside a live allocation.
bool resolve(const void *ptr, DeviceRef *ref);

// Records a failure for aclGetRecentErrMsg and returns `code`.
int fail(int code, const std::string &message);

// A failed RPC as an aclnn status (the server's 161001/161002/..., else 361001), recorded as the recent error.
int rpc_failure(const grpc::Status &status);

}  // namespace aclnn_remote
