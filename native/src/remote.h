// The connection to aclnn-serve (libascendcl), shared by the operators (libopapi).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "aclnn/v1/aclnn.grpc.pb.h"

namespace aclnn_remote {

// The handles of one kind a program holds (streams, contexts, executors): those made and not yet
// ended, each with what the library keeps of it (if anything). A stale or foreign handle is refused; handles
// are never reused (new_handle), so a stale one cannot name a newer handle's value.
template <typename Value = std::monostate>
class Registry {
public:
    Registry() = default;
    Registry(std::initializer_list<std::pair<const void *const, Value>> initial) : live_(initial) {}
    void add(const void *handle, Value value = {})
    {
        std::lock_guard<std::mutex> hold(lock_);
        live_[handle] = value;
    }
    std::optional<Value> find(const void *handle) const
    {
        std::lock_guard<std::mutex> hold(lock_);
        auto it = live_.find(handle);
        return it == live_.end() ? std::nullopt : std::optional<Value>(it->second);
    }
    bool remove(const void *handle)
    {
        std::lock_guard<std::mutex> hold(lock_);
        return live_.erase(handle) != 0;
    }
    // Applies `change` to a live handle's value, atomically; false when the handle is not live.
    template <typename F>
    bool update(const void *handle, F &&change)
    {
        std::lock_guard<std::mutex> hold(lock_);
        auto it = live_.find(handle);
        if (it == live_.end()) return false;
        change(it->second);
        return true;
    }
    // Applies `change` to every live handle's value, atomically.
    template <typename F>
    void each(F &&change)
    {
        std::lock_guard<std::mutex> hold(lock_);
        for (auto &entry : live_) change(entry.second);
    }

private:
    mutable std::mutex lock_;
    std::map<const void *, Value> live_;
};

// A handle (stream, context, executor) no other handle ever was: an address in a reserved range no object
// has, given out once, so a handle past its end never names a newer one (a freed object's address soon
// is another's). Never dereferenced: the registries map it to what it stands for. Null when exhausted.
void *new_handle();

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

// A call was queued on stream `stream` (the server answered its launch): a timed synchronize waits for
// an answer that covers it, and takes any answer that began after it.
void launched(int64_t stream);

// Resolves a pointer into device memory; false when it is not inside a live allocation.
bool resolve(const void *ptr, DeviceRef *ref);

// Records a failure for aclGetRecentErrMsg and returns `code`.
int fail(int code, const std::string &message);

// A failed RPC as an aclnn status (the server's 161001/161002/..., else 361001), recorded as the recent error.
int rpc_failure(const grpc::Status &status);

}  // namespace aclnn_remote
