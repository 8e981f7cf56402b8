// libascendcl: the connection to aclnn-serve, device memory and streams (CANN's runtime API).
//
// Device memory is buffers on the server, in this process's session. aclrtMalloc hands out
// addresses from a range reserved here with no access (PROT_NONE), one region per allocation, so
// that pointer arithmetic inside an allocation maps back to (buffer, byte offset), a host pointer
// is told apart from device memory, and dereferencing a device pointer on the host faults at once.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <vector>

#include <grpcpp/generic/generic_stub.h>

#include "acl/acl.h"
#include "aclnn/acl_meta.h"
#include "aclnn_rpc_status.pb.h"
#include "remote.h"

namespace aclnn_remote {
namespace {

constexpr size_t kChunkBytes = 1 << 20;  // bytes per message of a streamed transfer
constexpr size_t kAlign = 512;           // allocations start at multiples of this (as CANN's)
constexpr size_t kMaxBytes = size_t{1} << 62;  // the most bytes anything addresses (SPEC 1.4)
constexpr size_t kHandleSpace = size_t{1} << 36;  // reserved for handles: 2^33 of them, 8 bytes apart
constexpr int kReconnectWaitMs = 1000;  // how long a call waits for a server that was unreachable
constexpr auto kKeepAlive = std::chrono::seconds(10);
// HTTP/2 pings while a call is open (ACLNN_REMOTE_PING_S): a server that stops answering (its host
// gone, a network cut, the process stopped) fails the call, which would otherwise wait forever; as
// aclnn_common.liveness does for Python clients, whose servers take pings this often.
constexpr double kPingS = 30;
constexpr double kPingTimeoutS = 20;
constexpr double kStartWaitS = 600;  // ACLNN_REMOTE_START_WAIT_S's default: a cold cpu backend compiles for minutes
constexpr auto kStartPoll = std::chrono::milliseconds(250);
constexpr auto kStartReport = std::chrono::seconds(30);  // how often a wait says it still waits

thread_local std::string recent_error;

std::string environment(const char *name, const char *fallback = "")
{
    const char *value = std::getenv(name);
    return value && *value ? value : fallback;
}

std::string read_file(const std::string &path)
{
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
}

// "host:port", a comma-separated list of them (gRPC's ipv4: list), or any gRPC target ("dns:///name:port").
std::string grpc_target(const std::string &spec)
{
    if (spec.find(',') != std::string::npos && spec.find(':') != std::string::npos &&
        spec.find("//") == std::string::npos && spec.rfind("ipv", 0) != 0)
        return "ipv4:" + spec;
    return spec;
}

struct Connection {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<aclnn::v1::Aclnn::Stub> stub;
    std::string session;
    std::string token;
    std::string config_error;  // what is wrong with the environment's settings: aclInit and aclrtSetDevice fail
};

// A setting in seconds: unset gives `fallback`; anything but a finite number >= 0 is an error (NaN
// compared with nothing: a wait of "nan" never ended).
bool seconds_setting(const char *name, double fallback, double *value, std::string *error)
{
    std::string given = environment(name);
    *value = fallback;
    if (given.empty()) return true;
    char *end = nullptr;
    double parsed = std::strtod(given.c_str(), &end);
    if (*end != '\0' || !std::isfinite(parsed) || parsed < 0) {
        *error = std::string(name) + "=" + given + " is not a number of seconds >= 0";
        return false;
    }
    *value = parsed;
    return true;
}

// gRPC aborts the process on a header value outside printable ASCII (a token file's stray byte).
bool header_value(const std::string &text)
{
    return std::all_of(text.begin(), text.end(), [](unsigned char ch) { return ch >= 0x20 && ch < 0x7f; });
}

Connection *connect()
{
    auto *c = new Connection;
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    std::string roots = environment("ACLNN_REMOTE_ROOT_CERTS");
    if (!roots.empty() || environment("ACLNN_REMOTE_TLS") == "1") {
        grpc::SslCredentialsOptions tls;
        if (!roots.empty()) {
            tls.pem_root_certs = read_file(roots);
            if (tls.pem_root_certs.empty())
                c->config_error = "ACLNN_REMOTE_ROOT_CERTS=" + roots + ": no certificates read from it";
        }
        credentials = grpc::SslCredentials(tls);
    } else {
        credentials = grpc::InsecureChannelCredentials();
    }
    std::string token_file = environment("ACLNN_REMOTE_TOKEN_FILE");
    if (!token_file.empty()) {
        std::string token = read_file(token_file);
        token.erase(token.find_last_not_of(" \t\r\n") + 1);
        token.erase(0, token.find_first_not_of(" \t\r\n"));
        token = token.substr(0, token.find_first_of("\r\n"));  // the file's first token
        if (token.empty())
            c->config_error = "ACLNN_REMOTE_TOKEN_FILE=" + token_file + ": no token read from it";
        else if (!header_value(token))
            c->config_error = "ACLNN_REMOTE_TOKEN_FILE=" + token_file +
                              ": the token holds a byte that is not printable ASCII (a tab, a control or non-ASCII "
                              "character)";
        else
            c->token = token;
    }
    double ping_s;  // the default when the setting is unusable (then aclInit fails, naming it)
    seconds_setting("ACLNN_REMOTE_PING_S", kPingS, &ping_s, &c->config_error);
    grpc::ChannelArguments arguments;
    // A token in clear goes straight to the server, never through an HTTP proxy, which would read it.
    if (!c->token.empty() && roots.empty() && environment("ACLNN_REMOTE_TLS") != "1")
        arguments.SetInt(GRPC_ARG_ENABLE_HTTP_PROXY, 0);
    arguments.SetMaxReceiveMessageSize(-1);
    arguments.SetMaxSendMessageSize(-1);
    // A server back from a restart is reached within a second, as by the Python client (gRPC's default
    // backoff grows to two minutes: calls failed for 16 s after a 100 s outage).
    arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    arguments.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 1000);  // a name is asked again as often
    if (ping_s > 0) {
        int ping_ms = static_cast<int>(std::min(ping_s, 86400.0) * 1000);
        int timeout_ms = static_cast<int>(std::min(ping_s, kPingTimeoutS) * 1000);
        arguments.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, std::max(ping_ms, 1));
        arguments.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, std::max(timeout_ms, 1));
        arguments.SetInt("grpc.http2.ping_timeout_ms", std::max(timeout_ms, 1));  // any ping's answer, not only keepalive's
        arguments.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
        arguments.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // else a quiet call is pinged twice, then never
    }
    c->channel = grpc::CreateCustomChannel(grpc_target(environment("ACLNN_REMOTE_TARGET", "127.0.0.1:50051")),
                                           credentials, arguments);
    c->stub = aclnn::v1::Aclnn::NewStub(c->channel);
    std::random_device random;
    std::ostringstream session;
    for (int i = 0; i < 4; i++) session << std::hex << static_cast<uint32_t>(random());
    c->session = session.str();
    return c;
}

// Created on first use and never destroyed: gRPC's own statics may be gone when this process exits.
Connection &connection()
{
    static Connection *c = connect();
    return *c;
}

// The reserved address range and the allocations in it.
class AddressSpace {
public:
    // A region for `size` bytes of buffer `id`; 0 when the range is full.
    uintptr_t take(size_t size, const std::string &id)
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (!reserve()) return 0;
        size_t length = (size + 2 * kAlign - 1) / kAlign * kAlign;  // a gap after each: end pointers stay unique
        for (auto it = free_.begin(); it != free_.end(); ++it) {
            if (it->second < length) continue;
            uintptr_t start = it->first;
            size_t left = it->second - length;
            free_.erase(it);
            if (left) free_[start + length] = left;
            live_[start] = Allocation{id, size, length};
            return start;
        }
        return 0;
    }

    // The buffer id of the allocation starting at `start` (false: none does).
    bool starts(uintptr_t start, std::string *id)
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = live_.find(start);
        if (it == live_.end()) return false;
        *id = it->second.id;
        return true;
    }

    // Releases the allocation starting at `start` if it is buffer `id`'s (false: none such).
    bool release(uintptr_t start, const std::string &id)
    {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = live_.find(start);
        if (it == live_.end() || it->second.id != id) return false;
        size_t length = it->second.length;
        live_.erase(it);
        auto next = free_.lower_bound(start);
        if (next != free_.end() && next->first == start + length) {
            length += next->second;
            free_.erase(next);
        }
        auto previous = free_.lower_bound(start);
        if (previous != free_.begin() && (--previous)->first + previous->second == start) {
            previous->second += length;
        } else {
            free_[start] = length;
        }
        return true;
    }

    bool resolve(const void *ptr, DeviceRef *ref)
    {
        auto p = reinterpret_cast<uintptr_t>(ptr);
        std::lock_guard<std::mutex> lock(mu_);
        auto it = live_.upper_bound(p);
        if (it == live_.begin()) return false;
        --it;
        if (p - it->first > it->second.size) return false;  // past the end (one past it is still a pointer)
        ref->buffer = it->second.id;
        ref->offset = p - it->first;
        ref->available = it->second.size - ref->offset;
        return true;
    }

    bool contains(const void *ptr)
    {
        auto p = reinterpret_cast<uintptr_t>(ptr);
        std::lock_guard<std::mutex> lock(mu_);
        return base_ && p >= base_ && p < base_ + length_;
    }

private:
    struct Allocation {
        std::string id;
        size_t size;
        size_t length;
    };

    bool reserve()
    {
        if (base_) return true;
        for (size_t length = size_t(1) << 42; length >= (size_t(1) << 30); length >>= 1) {
            void *p = mmap(nullptr, length, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p != MAP_FAILED) {
                base_ = reinterpret_cast<uintptr_t>(p);
                length_ = length;
                free_[(base_ + kAlign - 1) / kAlign * kAlign] = length - kAlign;
                return true;
            }
        }
        return false;
    }

    std::mutex mu_;
    uintptr_t base_ = 0;
    size_t length_ = 0;
    std::map<uintptr_t, size_t> free_;       // start -> length
    std::map<uintptr_t, Allocation> live_;  // start -> allocation
};

AddressSpace &address_space()
{
    static AddressSpace *space = new AddressSpace;
    return *space;
}

// The blocks aclrtMallocHost gave and aclrtFreeHost has not taken back.
class HostBlocks {
public:
    void add(void *block)
    {
        std::lock_guard<std::mutex> lock(mu_);
        live_.insert(block);
    }

    bool remove(void *block)
    {
        std::lock_guard<std::mutex> lock(mu_);
        return live_.erase(block) == 1;
    }

private:
    std::mutex mu_;
    std::unordered_set<void *> live_;
};

HostBlocks &host_blocks()
{
    static HostBlocks *blocks = new HostBlocks;  // never destroyed, as the registries above
    return *blocks;
}

// Renews the session's lease while the process holds device memory (the server frees a lapsed session's).
void keep_alive()
{
    static std::once_flag started;
    std::call_once(started, [] {
        // Within a third of the lease the server states (its --session-ttl-s), at least every kKeepAlive;
        // the first renewal at once, to learn it.
        std::thread([] {
            auto period = std::chrono::duration<double>(0);
            for (;;) {
                std::this_thread::sleep_for(period);
                aclnn::v1::Empty request;
                aclnn::v1::Lease lease;
                period = kKeepAlive;
                grpc::Status status = stub().KeepAlive(context().get(), request, &lease);  // a failure: the next call reports it
                if (status.ok() && lease.session_ttl_s() > 0)
                    period = std::min(period, std::chrono::duration<double>(std::max(lease.session_ttl_s() / 3, 0.05)));
            }
        }).detach();
    });
}

// The registries below are never destroyed, as the connection is not: a thread still inside a call when
// the program returns from main (another thread waiting on a stream, say) must not find them freed.
std::atomic<int64_t> next_stream{1};
Registry<int64_t> &live_streams = *new Registry<int64_t>;  // created and not yet destroyed, with their ids
std::atomic<int> initialized{0};

// Contexts: handles on the one device, each thread's current one. They hold nothing of their own:
// streams and device memory belong to the process (its session on the server), which a program
// correct on CANN, keeping each stream in its context, cannot tell apart.
struct Context {};
Context default_context;
Registry<bool> &contexts = *new Registry<bool>{{&default_context, true}};  // the live ones; whether each is the default
std::atomic<bool> device_set{false};
thread_local Context *current_context = nullptr;

bool live_context(Context *context) { return contexts.find(context).has_value(); }

// A runtime (aclrt*) failure's aclError: the server refused the arguments, it is out of memory, or else.
// grpc.health.v1.Health/Check of the service aclnn.v1.Aclnn, its two one-field messages encoded here
// (no generated classes: a program linking gRPC's own health protos would register them twice).
enum class Health { kServing, kNotServing, kUnknown };

Health health()
{
    static const std::string request = std::string("\x0a\x0e", 2) + "aclnn.v1.Aclnn";  // service = "aclnn.v1.Aclnn"
    grpc::Slice slice(request);
    grpc::ByteBuffer sent(&slice, 1), received;
    grpc::GenericStub generic(connection().channel);
    auto ctx = context();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    std::promise<grpc::Status> done;
    generic.UnaryCall(ctx.get(), "/grpc.health.v1.Health/Check", grpc::StubOptions(), &sent, &received,
                      [&done](grpc::Status status) { done.set_value(std::move(status)); });
    if (!done.get_future().get().ok()) return Health::kUnknown;
    std::vector<grpc::Slice> slices;
    std::string reply;
    if (received.Dump(&slices).ok())
        for (const auto &part : slices) reply.append(reinterpret_cast<const char *>(part.begin()), part.size());
    if (reply == std::string("\x08\x01", 2)) return Health::kServing;  // status = SERVING
    return reply == std::string("\x08\x02", 2) ? Health::kNotServing : Health::kUnknown;
}

// CANN's aclrtSetDevice returns once the device is up; here, once the server's backend is: a server
// that answers NOT_SERVING is loading it (a cold cpu backend compiles its kernels for minutes, an NPU
// initializes) and refuses calls meanwhile. Waits up to ACLNN_REMOTE_START_WAIT_S seconds, saying so
// on stderr when it starts waiting and every 30 s; a server away or serving is not waited for (the
// calls say what they find), and once serving it is not asked again.
aclError wait_until_serving()
{
    static std::atomic<bool> served{false};
    if (served) return ACL_SUCCESS;
    double limit_s = kStartWaitS;
    std::string error;
    if (!seconds_setting("ACLNN_REMOTE_START_WAIT_S", kStartWaitS, &limit_s, &error))
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtSetDevice: " + error);
    const auto started = std::chrono::steady_clock::now();
    auto reported = started - kStartReport;
    for (Health state = health(); state == Health::kNotServing; state = health()) {
        auto now = std::chrono::steady_clock::now();
        double waited_s = std::chrono::duration<double>(now - started).count();
        std::string target = environment("ACLNN_REMOTE_TARGET", "127.0.0.1:50051");
        if (waited_s >= limit_s)
            return fail(ACL_ERROR_RT_INTERNAL_ERROR, "aclrtSetDevice: the server at " + target +
                                                         " is still starting (NOT_SERVING) after " +
                                                         std::to_string(static_cast<int>(waited_s)) +
                                                         " s (ACLNN_REMOTE_START_WAIT_S)");
        if (now - reported >= kStartReport) {
            std::fprintf(stderr, "aclnn-remote: the server at %s is starting (NOT_SERVING); waiting %.0f s so far, "
                         "up to %.0f (ACLNN_REMOTE_START_WAIT_S)\n", target.c_str(), waited_s, limit_s);
            reported = now;
        }
        std::this_thread::sleep_for(kStartPoll);
    }
    served = true;
    return ACL_SUCCESS;
}

aclError runtime_failure(const grpc::Status &status)
{
    int code = rpc_failure(status);
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) return ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (code == ACLNN_ERR_PARAM_NULLPTR || code == ACLNN_ERR_PARAM_INVALID) return ACL_ERROR_INVALID_PARAM;
    return ACL_ERROR_RT_INTERNAL_ERROR;
}

// `count` bytes of device memory at `ptr`, or an error recorded for `what`.
aclError device_range(const void *ptr, size_t count, const char *what, DeviceRef *ref)
{
    if (!resolve(ptr, ref))
        return fail(ACL_ERROR_INVALID_PARAM, std::string(what) + ": not device memory (a pointer from aclrtMalloc)");
    if (count > ref->available)
        return fail(ACL_ERROR_INVALID_PARAM, std::string(what) + ": " + std::to_string(count) +
                                                 " bytes run past the end of its allocation");
    return ACL_SUCCESS;
}

aclError host_range(const void *ptr, size_t count, const char *what)
{
    if (count && !ptr) return fail(ACL_ERROR_INVALID_PARAM, std::string(what) + ": is null");
    if (address_space().contains(ptr))
        return fail(ACL_ERROR_INVALID_PARAM, std::string(what) + ": is device memory, not host memory");
    return ACL_SUCCESS;
}

aclError write(const DeviceRef &dst, const void *src, size_t count)
{
    aclnn::v1::Empty reply;
    auto ctx = context();
    std::unique_ptr<grpc::ClientWriter<aclnn::v1::BufferWrite>> writer(stub().WriteBuffer(ctx.get(), &reply));
    const char *bytes = static_cast<const char *>(src);
    size_t sent = 0;
    do {
        aclnn::v1::BufferWrite message;
        if (sent == 0) {
            message.set_buffer(dst.buffer);
            message.set_offset(dst.offset);
            message.set_size(count);
        }
        size_t n = std::min(kChunkBytes, count - sent);
        message.set_data(bytes + sent, n);
        sent += n;
        if (!writer->Write(message)) break;  // the server ended the call: Finish says why
    } while (sent < count);
    writer->WritesDone();
    grpc::Status status = writer->Finish();
    return status.ok() ? ACL_SUCCESS : runtime_failure(status);
}

aclError read(void *dst, const DeviceRef &src, size_t count)
{
    aclnn::v1::BufferRange request;
    request.set_buffer(src.buffer);
    request.set_offset(src.offset);
    request.set_size(count);
    auto ctx = context();
    std::unique_ptr<grpc::ClientReader<aclnn::v1::TensorChunk>> reader(stub().ReadBuffer(ctx.get(), request));
    aclnn::v1::TensorChunk chunk;
    size_t received = 0;
    bool in_order = true;
    while (reader->Read(&chunk)) {
        if (chunk.offset() != received || received + chunk.data().size() > count) {
            in_order = false;
            continue;  // drained, then refused
        }
        if (chunk.data().empty()) continue;  // (an empty copy's one chunk: dst may be null)
        std::memcpy(static_cast<char *>(dst) + received, chunk.data().data(), chunk.data().size());
        received += chunk.data().size();
    }
    grpc::Status status = reader->Finish();
    if (!status.ok()) return runtime_failure(status);
    if (!in_order || received != count)
        return fail(ACL_ERROR_RT_INTERNAL_ERROR, "device -> host copy: the server sent " + std::to_string(received) +
                                                     " bytes out of order or of " + std::to_string(count));
    return ACL_SUCCESS;
}

// Waits for the stream's queued calls on the server (every stream: -1). *drained: whether the server
// answered once they had ended (a failure of one of them included), not only that the call failed.
aclError synchronize(int64_t stream, bool *drained = nullptr)
{
    aclnn::v1::Empty request, reply;
    grpc::Status status = stub().Synchronize(context(stream).get(), request, &reply);
    auto code = status.error_code();
    if (drained)
        *drained = code != grpc::StatusCode::UNAVAILABLE && code != grpc::StatusCode::DEADLINE_EXCEEDED &&
                   code != grpc::StatusCode::CANCELLED && code != grpc::StatusCode::UNAUTHENTICATED;
    return status.ok() ? ACL_SUCCESS : rpc_failure(status);  // a queued call's failure: its own status
}

// Events. An event recorded on a stream stands for the stream's work queued so far: it is complete once a
// synchronize of that stream that began after the record has answered. Records and synchronizes draw
// tickets from one counter, so a synchronize covers the records with smaller tickets.
std::atomic<uint64_t> tickets{0};

struct Event {
    enum State { kUnrecorded, kPending, kComplete, kFailed } state = kUnrecorded;
    int64_t stream = 0;   // the stream id it was recorded on
    uint64_t ticket = 0;  // its record's
    aclError code = ACL_SUCCESS;  // kFailed: the failure its stream's synchronize answered, and its message
    std::string message;
};
Registry<Event> &live_events = *new Registry<Event>;  // created and not yet destroyed

struct Outcome {
    aclError code = ACL_SUCCESS;
    std::string message;
    bool drained = false;
};

// A synchronize of one stream, under way or finished and not yet collected; its ticket was drawn when it began.
struct Waiter {
    uint64_t ticket = 0;
    std::shared_future<Outcome> done;
};
std::mutex &waiters_lock = *new std::mutex;
std::map<int64_t, Waiter> &waiters = *new std::map<int64_t, Waiter>;  // stream id -> its synchronize (shared)
std::map<int64_t, uint64_t> &last_launches = *new std::map<int64_t, uint64_t>;  // stream id -> its last launch's ticket
constexpr aclError kStillRunning = -1;  // wait_for: the timeout passed first

// The events pending on `stream` (every stream: -1) with tickets below `ticket`: complete, or failed when the
// synchronize answered a queued call's failure (which of the stream's calls failed, before the record or after,
// the server does not say: such an event is not known to be complete). Not drained (the server unreachable):
// they stay pending, for a later wait to ask again.
void settle(int64_t stream, uint64_t ticket, const Outcome &outcome)
{
    if (!outcome.drained) return;
    live_events.each([&](Event &event) {
        if (event.state != Event::kPending || event.ticket >= ticket || (stream >= 0 && event.stream != stream))
            return;
        event.state = outcome.code == ACL_SUCCESS ? Event::kComplete : Event::kFailed;
        event.code = outcome.code;
        event.message = outcome.message;
    });
}

// The synchronize of stream `id` under way, else a new one: on a thread of its own when `detached` (its caller
// may stop waiting: the synchronize goes on, and its outcome is kept for the next wait), else on the caller's.
Waiter waiter_for(int64_t id, bool detached)
{
    auto promise = std::make_shared<std::promise<Outcome>>();
    Waiter waiter;
    {
        std::lock_guard<std::mutex> hold(waiters_lock);
        auto it = waiters.find(id);
        if (it != waiters.end()) return it->second;
        waiter = Waiter{++tickets, promise->get_future().share()};
        waiters[id] = waiter;
    }
    auto run = [id, promise] {
        Outcome outcome;
        outcome.code = synchronize(id, &outcome.drained);
        if (outcome.code != ACL_SUCCESS) outcome.message = recent_error;  // this thread's
        promise->set_value(std::move(outcome));
    };
    if (detached) {
        try {
            std::thread(run).detach();
            return waiter;
        } catch (const std::system_error &) {  // no thread to be had: the caller waits it out
        }
    }
    run();
    return waiter;
}

// A finished synchronize's outcome: the first to collect it settles its events and reports a queued call's
// failure (once, as the server reports it once; for the others that is success). A synchronize that never
// reached the server fails for every caller that waited on it.
aclError collect(int64_t id, const Waiter &waiter)
{
    const Outcome &outcome = waiter.done.get();
    bool first = false;
    {
        std::lock_guard<std::mutex> hold(waiters_lock);
        auto it = waiters.find(id);
        if (it != waiters.end() && it->second.ticket == waiter.ticket) {
            first = true;
            settle(id, waiter.ticket, outcome);  // before it is gone: a wait that finds it gone sees the events so
            waiters.erase(it);
        }
    }
    if (outcome.code == ACL_SUCCESS || (!first && outcome.drained)) return ACL_SUCCESS;
    return fail(outcome.code, outcome.message);
}

// Waits until a synchronize of stream `id` drawn after ticket `after` has answered (one under way that began
// earlier is waited for, then another begun), up to `timeout_ms` (-1: for ever; 0: only collects one that
// has answered). ACL_SUCCESS, a queued call's failure, or kStillRunning.
aclError wait_for(int64_t id, uint64_t after, int32_t timeout_ms)
{
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
    for (;;) {
        Waiter waiter = waiter_for(id, timeout_ms >= 0);
        if (timeout_ms < 0)
            waiter.done.wait();
        else if (waiter.done.wait_until(until) != std::future_status::ready)
            return kStillRunning;
        if (aclError code = collect(id, waiter)) return code;
        if (waiter.ticket > after) return ACL_SUCCESS;
    }
}

// Waits for everything queued on stream `id` so far.
aclError drain(int64_t id) { return wait_for(id, ++tickets, -1); }

// A timed wait's timeout below -1 (-1 waits for ever): CANN's own check, and its code.
aclError timeout_below_minus_1(const char *function, int32_t timeout)
{
    return fail(ACL_ERROR_RT_PARAM_INVALID, std::string(function) + ": timeout " + std::to_string(timeout) +
                                                " is below -1 (-1 waits for ever)");
}

}  // namespace

void launched(int64_t stream)
{
    std::lock_guard<std::mutex> hold(waiters_lock);
    last_launches[stream] = ++tickets;
}

namespace {

aclError create_event(aclrtEvent *event, const char *function)
{
    if (!event) return fail(ACL_ERROR_INVALID_PARAM, std::string(function) + ": event is null");
    void *created = new_handle();
    if (!created)
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, std::string(function) + ": no handle left in this process");
    live_events.add(created);
    *event = created;
    return ACL_SUCCESS;
}

aclError not_an_event(const char *function)
{
    return fail(ACL_ERROR_INVALID_PARAM, std::string(function) + ": not a live event (from aclrtCreateEvent)");
}

// Waits (up to `timeout_ms`) for the work an event stands for; kStillRunning when the timeout passed first.
aclError wait_event(aclrtEvent handle, int32_t timeout_ms, const char *function)
{
    if (!handle) return fail(ACL_ERROR_INVALID_PARAM, std::string(function) + ": event is null");
    auto event = live_events.find(handle);
    if (!event) return not_an_event(function);
    if (event->state == Event::kPending) {
        if (aclError code = wait_for(event->stream, event->ticket, timeout_ms)) return code;
        event = live_events.find(handle);
        if (!event) return ACL_SUCCESS;  // destroyed meanwhile by another thread: its work is done
    }
    if (event->state == Event::kFailed)
        return fail(event->code, std::string(function) + ": the event's stream reported a failure while it was "
                                     "pending (" + event->message + ")");
    return ACL_SUCCESS;  // complete, or never recorded (it stands for no work)
}

// The copy's direction: the kinds that name one of the four, and ACL_MEMCPY_DEFAULT's from the addresses
// (device memory is this process's reserved range, freed allocations included: those are then refused).
aclrtMemcpyKind direction(aclrtMemcpyKind kind, const void *dst, const void *src)
{
    switch (kind) {
    case ACL_MEMCPY_DEFAULT: {
        bool to_device = address_space().contains(dst), from_device = address_space().contains(src);
        if (to_device) return from_device ? ACL_MEMCPY_DEVICE_TO_DEVICE : ACL_MEMCPY_HOST_TO_DEVICE;
        return from_device ? ACL_MEMCPY_DEVICE_TO_HOST : ACL_MEMCPY_HOST_TO_HOST;
    }
    case ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE:  // the copy is done when the call returns: the host memory is free
        return ACL_MEMCPY_HOST_TO_DEVICE;
    case ACL_MEMCPY_INNER_DEVICE_TO_DEVICE:
    case ACL_MEMCPY_INTER_DEVICE_TO_DEVICE:  // one device: both are within it
        return ACL_MEMCPY_DEVICE_TO_DEVICE;
    default:
        return kind;
    }
}

aclError not_a_stream(const char *function)
{
    return fail(ACL_ERROR_INVALID_PARAM, std::string(function) + ": not a live stream (from aclrtCreateStream)");
}

}  // namespace

void *new_handle()
{
    static const uintptr_t base = [] {
        void *range = mmap(nullptr, kHandleSpace, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        return range == MAP_FAILED ? uintptr_t{0} : reinterpret_cast<uintptr_t>(range);
    }();
    static std::atomic<uint64_t> next{0};
    uint64_t n = next++;
    return base && n < kHandleSpace / 8 ? reinterpret_cast<void *>(base + n * 8) : nullptr;
}

aclnn::v1::Aclnn::Stub &stub() { return *connection().stub; }

std::unique_ptr<grpc::ClientContext> context(int64_t stream)
{
    auto ctx = std::make_unique<grpc::ClientContext>();
    Connection &c = connection();
    // A server back from a restart is tried at once, and the call waits for it a moment (else a call made
    // between gRPC's reconnection attempts fails at once: 10 s after a 5 s outage, here); one still away
    // answers the call UNAVAILABLE after that moment.
    auto deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(kReconnectWaitMs);
    bool retried = false;
    for (auto state = c.channel->GetState(true); state != GRPC_CHANNEL_READY; state = c.channel->GetState(true)) {
        if (state == GRPC_CHANNEL_TRANSIENT_FAILURE && !retried) {
            grpc::experimental::ChannelResetConnectionBackoff(c.channel.get());
            retried = true;
        }
        if (!c.channel->WaitForStateChange(state, deadline)) break;
    }
    ctx->AddMetadata("x-aclnn-session", c.session);
    if (!c.token.empty()) ctx->AddMetadata("authorization", "Bearer " + c.token);
    if (stream >= 0) ctx->AddMetadata("x-aclnn-stream", std::to_string(stream));
    return ctx;
}

int64_t stream_id(void *stream)
{
    if (!stream) return 0;  // the default stream
    return live_streams.find(stream).value_or(-1);
}

bool resolve(const void *ptr, DeviceRef *ref) { return address_space().resolve(ptr, ref); }

int fail(int code, const std::string &message)
{
    recent_error = message;
    return code;
}

int rpc_failure(const grpc::Status &status)
{
    int code = ACLNN_ERR_RUNTIME_ERROR;
    aclnn_native::RpcStatus details;
    if (!status.error_details().empty() && details.ParseFromString(status.error_details())) {
        for (const auto &any : details.details()) {
            aclnn_native::RpcErrorInfo info;
            if (any.type_url().find("google.rpc.ErrorInfo") == std::string::npos ||
                !info.ParseFromString(any.value()) || info.domain() != "aclnn")
                continue;
            auto found = info.metadata().find("status");
            if (found == info.metadata().end()) continue;
            // A failure's status is a positive number: anything else (0, "abc", a sign) from a server
            // that lies or is broken stays a runtime error, never the success a 0 would report.
            char *end = nullptr;
            long parsed = std::strtol(found->second.c_str(), &end, 10);
            if (!found->second.empty() && *end == '\0' && parsed > 0 && parsed <= INT32_MAX)
                code = static_cast<int>(parsed);
        }
    }
    std::string message = status.error_message();
    if (code == ACLNN_ERR_RUNTIME_ERROR && message.find("UNAVAILABLE") == std::string::npos &&
        status.error_code() == grpc::StatusCode::UNAVAILABLE)
        message = "UNAVAILABLE: the server at " + environment("ACLNN_REMOTE_TARGET", "127.0.0.1:50051") +
                  " cannot be reached: " + message;
    return fail(code, message);
}

}  // namespace aclnn_remote

using namespace aclnn_remote;

extern "C" {

const char *aclGetRecentErrMsg(void) { return recent_error.empty() ? nullptr : recent_error.c_str(); }

aclError aclInit(const char *)
{
    if (initialized.exchange(1)) return fail(ACL_ERROR_REPEAT_INITIALIZE, "aclInit: already initialized");
    const std::string &error = connection().config_error;
    if (!error.empty()) {
        initialized = 0;
        return fail(ACL_ERROR_INVALID_PARAM, "aclInit: " + error);
    }
    return ACL_SUCCESS;
}

aclError aclFinalize(void)
{
    if (!initialized.exchange(0)) return fail(ACL_ERROR_UNINITIALIZE, "aclFinalize: aclInit was not called");
    return ACL_SUCCESS;
}

// The pool is one device to a program: the server places the work.
aclError aclrtSetDevice(int32_t deviceId)
{
    if (deviceId != 0) return fail(ACL_ERROR_RT_INVALID_DEVICEID, "aclrtSetDevice: the server is device 0");
    const std::string &error = connection().config_error;
    if (!error.empty()) return fail(ACL_ERROR_INVALID_PARAM, "aclrtSetDevice: " + error);
    aclError waited = wait_until_serving();
    if (waited != ACL_SUCCESS) return waited;
    device_set = true;
    if (!current_context) current_context = &default_context;  // the device's default context, as CANN
    return ACL_SUCCESS;
}

aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId)
{
    if (!context) return fail(ACL_ERROR_INVALID_PARAM, "aclrtCreateContext: context is null");
    if (deviceId != 0) return fail(ACL_ERROR_RT_INVALID_DEVICEID, "aclrtCreateContext: the server is device 0");
    auto *created = static_cast<Context *>(new_handle());
    if (!created) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtCreateContext: no handle left in this process");
    contexts.add(created, false);
    device_set = true;
    current_context = created;  // a new context is the calling thread's current one
    *context = created;
    return ACL_SUCCESS;
}

aclError aclrtDestroyContext(aclrtContext context)
{
    auto *doomed = static_cast<Context *>(context);
    if (contexts.find(doomed).value_or(true) || !contexts.remove(doomed))  // unknown, the default, or ended meanwhile
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtDestroyContext: not a context from aclrtCreateContext");
    if (current_context == doomed) current_context = nullptr;
    return ACL_SUCCESS;
}

aclError aclrtSetCurrentContext(aclrtContext context)
{
    auto *chosen = static_cast<Context *>(context);
    if (!live_context(chosen)) return fail(ACL_ERROR_INVALID_PARAM, "aclrtSetCurrentContext: not a live context");
    current_context = chosen;
    return ACL_SUCCESS;
}

aclError aclrtGetCurrentContext(aclrtContext *context)
{
    if (!context) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetCurrentContext: context is null");
    Context *current = current_context;
    if (current && !live_context(current)) current = nullptr;  // destroyed on another thread
    if (!current && device_set) current = &default_context;
    if (!current) return fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtGetCurrentContext: no device set and no context made");
    *context = current;
    return ACL_SUCCESS;
}

// The program runs on a host beside its (remote) device, as on an Ascend card in a server.
aclError aclrtGetRunMode(aclrtRunMode *runMode)
{
    if (!runMode) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetRunMode: runMode is null");
    *runMode = ACL_HOST;
    return ACL_SUCCESS;
}

aclError aclrtResetDevice(int32_t deviceId) { return aclrtSetDevice(deviceId); }

aclError aclrtGetDevice(int32_t *deviceId)
{
    if (!deviceId) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDevice: deviceId is null");
    *deviceId = 0;
    return ACL_SUCCESS;
}

aclError aclrtGetDeviceCount(uint32_t *count)
{
    if (!count) return fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDeviceCount: count is null");
    *count = 1;
    return ACL_SUCCESS;
}

// Every stream: the synchronizes under way are collected first (one may hold a failure for its stream's
// next wait), then the server waits for all of them.
aclError aclrtSynchronizeDevice(void)
{
    std::vector<std::pair<int64_t, Waiter>> running;
    {
        std::lock_guard<std::mutex> hold(waiters_lock);
        running.assign(waiters.begin(), waiters.end());
    }
    aclError first = ACL_SUCCESS;
    std::string message;
    for (auto &[id, waiter] : running) {
        waiter.done.wait();
        aclError code = collect(id, waiter);
        if (code && !first) {
            first = code;
            message = recent_error;
        }
    }
    Outcome outcome;
    uint64_t ticket = ++tickets;
    outcome.code = synchronize(-1, &outcome.drained);
    outcome.message = outcome.code ? recent_error : "";
    settle(-1, ticket, outcome);  // a failure, of whichever stream: no pending event is known complete
    return first ? fail(first, message) : outcome.code;
}

aclError aclrtCreateStream(aclrtStream *stream)
{
    if (!stream) return fail(ACL_ERROR_INVALID_PARAM, "aclrtCreateStream: stream is null");
    void *created = new_handle();
    if (!created) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtCreateStream: no handle left in this process");
    live_streams.add(created, next_stream++);
    *stream = created;
    return ACL_SUCCESS;
}

aclError aclrtDestroyStream(aclrtStream stream)
{
    if (!stream) return fail(ACL_ERROR_INVALID_PARAM, "aclrtDestroyStream: stream is null");
    int64_t id = stream_id(stream);
    if (id < 0) return not_a_stream("aclrtDestroyStream");
    aclError code = drain(id);  // its queued calls finish first, as on the device
    live_streams.remove(stream);  // unless destroyed meanwhile elsewhere
    std::lock_guard<std::mutex> hold(waiters_lock);
    last_launches.erase(id);  // its id is never another stream's: nothing of it stays
    return code;
}

aclError aclrtSynchronizeStream(aclrtStream stream)
{
    int64_t id = stream_id(stream);
    return id < 0 ? not_a_stream("aclrtSynchronizeStream") : drain(id);
}

aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout)
{
    if (timeout < -1) return timeout_below_minus_1("aclrtSynchronizeStreamWithTimeout", timeout);
    int64_t id = stream_id(stream);
    if (id < 0) return not_a_stream("aclrtSynchronizeStreamWithTimeout");
    uint64_t after = 0;  // a synchronize begun after the stream's last launch covers everything queued on it
    {
        std::lock_guard<std::mutex> hold(waiters_lock);
        auto found = last_launches.find(id);
        if (found != last_launches.end()) after = found->second;
    }
    aclError code = wait_for(id, after, timeout);
    if (code != kStillRunning) return code;
    return fail(ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
                "aclrtSynchronizeStreamWithTimeout: the stream's calls still ran after " + std::to_string(timeout) +
                    " ms");
}

aclError aclrtCreateEvent(aclrtEvent *event) { return create_event(event, "aclrtCreateEvent"); }

// Every flag names a device-side capability (timestamps, cross-stream waits, device-only use, capture, IPC)
// that adds nothing here: events all behave alike. Bits CANN does not define are refused.
aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag)
{
    constexpr uint32_t known = ACL_EVENT_SYNC | ACL_EVENT_CAPTURE_STREAM_PROGRESS | ACL_EVENT_TIME_LINE |
                               ACL_EVENT_DEVICE_USE_ONLY | ACL_EVENT_EXTERNAL | ACL_EVENT_IPC;
    if (flag & ~known)
        return fail(ACL_ERROR_INVALID_PARAM,
                    "aclrtCreateEventWithFlag: flag " + std::to_string(flag) + " has bits CANN does not define");
    return create_event(event, "aclrtCreateEventWithFlag");
}

// Nothing waits on the device for an event here (waits are the host's), so it may go at once.
aclError aclrtDestroyEvent(aclrtEvent event)
{
    if (!event) return fail(ACL_ERROR_INVALID_PARAM, "aclrtDestroyEvent: event is null");
    return live_events.remove(event) ? ACL_SUCCESS : not_an_event("aclrtDestroyEvent");
}

// Stands for the work queued on the stream so far; a record again stands for the work queued by then.
aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream)
{
    if (!event) return fail(ACL_ERROR_INVALID_PARAM, "aclrtRecordEvent: event is null");
    int64_t id = stream_id(stream);
    if (id < 0) return not_a_stream("aclrtRecordEvent");
    bool live = live_events.update(event, [id](Event &e) {
        e = Event{};
        e.state = Event::kPending;
        e.stream = id;
        e.ticket = ++tickets;
    });
    return live ? ACL_SUCCESS : not_an_event("aclrtRecordEvent");
}

// Back to never recorded. On a device, the reset is queued on `stream`, after its waits; here those waits
// were the host's and have returned, so it takes effect at once.
aclError aclrtResetEvent(aclrtEvent event, aclrtStream stream)
{
    if (!event) return fail(ACL_ERROR_INVALID_PARAM, "aclrtResetEvent: event is null");
    if (stream_id(stream) < 0) return not_a_stream("aclrtResetEvent");
    return live_events.update(event, [](Event &e) { e = Event{}; }) ? ACL_SUCCESS : not_an_event("aclrtResetEvent");
}

// Never blocks: the first query of a pending event starts a synchronize of its stream, which later queries
// (and waits) collect once it has answered; COMPLETE only once one that began after the record has answered.
aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status)
{
    if (!event) return fail(ACL_ERROR_INVALID_PARAM, "aclrtQueryEventStatus: event is null");
    if (!status) return fail(ACL_ERROR_INVALID_PARAM, "aclrtQueryEventStatus: status is null");
    auto found = live_events.find(event);
    if (!found) return not_an_event("aclrtQueryEventStatus");
    if (found->state == Event::kPending) {
        aclError code = wait_for(found->stream, found->ticket, 0);
        if (code != ACL_SUCCESS && code != kStillRunning) return code;  // a queued call's failure, reported here
        found = live_events.find(event);
        if (!found) return not_an_event("aclrtQueryEventStatus");
    }
    *status = found->state == Event::kComplete ? ACL_EVENT_RECORDED_STATUS_COMPLETE
                                               : ACL_EVENT_RECORDED_STATUS_NOT_READY;
    return ACL_SUCCESS;
}

aclError aclrtSynchronizeEvent(aclrtEvent event) { return wait_event(event, -1, "aclrtSynchronizeEvent"); }

aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout)
{
    if (timeout < -1) return timeout_below_minus_1("aclrtSynchronizeEventWithTimeout", timeout);
    aclError code = wait_event(event, timeout, "aclrtSynchronizeEventWithTimeout");
    if (code != kStillRunning) return code;
    return fail(ACL_ERROR_RT_EVENT_SYNC_TIMEOUT,
                "aclrtSynchronizeEventWithTimeout: the event's work still ran after " + std::to_string(timeout) +
                    " ms");
}

// The host waits for the event's work before returning, so whatever the program queues on `stream` next
// reaches the server after it: the order the device's wait would give (the work queued on `stream` before
// the wait runs on meanwhile, as on a device).
aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event)
{
    if (stream_id(stream) < 0) return not_a_stream("aclrtStreamWaitEvent");
    return wait_event(event, -1, "aclrtStreamWaitEvent");
}

// CANN's value is the device time between the two records. The server does not report when queued calls
// run, and host clocks would measure the network instead: refused, after the arguments are checked.
aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent)
{
    if (!ms) return fail(ACL_ERROR_INVALID_PARAM, "aclrtEventElapsedTime: ms is null");
    if (!startEvent || !endEvent) return fail(ACL_ERROR_INVALID_PARAM, "aclrtEventElapsedTime: an event is null");
    if (!live_events.find(startEvent)) return not_an_event("aclrtEventElapsedTime startEvent");
    if (!live_events.find(endEvent)) return not_an_event("aclrtEventElapsedTime endEvent");
    return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                "aclrtEventElapsedTime: the remote device's timestamps are not available (the server does not "
                "report when queued calls run)");
}

aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy)
{
    if (!devPtr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc: devPtr is null");
    if (size == 0) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc: size is 0");
    aclnn::v1::MallocRequest request;
    request.set_size(size);
    aclnn::v1::BufferInfo reply;
    grpc::Status status = stub().MallocBuffer(context().get(), request, &reply);
    // A size the server can never hold (past its share or budget) is memory it lacks, as on a device; only
    // a size past any address (2^62 bytes) is a wrong argument.
    if (!status.ok() && size <= kMaxBytes && rpc_failure(status) == ACLNN_ERR_PARAM_INVALID)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (!status.ok()) return runtime_failure(status);
    uintptr_t start = address_space().take(size, reply.buffer());
    if (!start) {
        aclnn::v1::BufferRef buffer;
        buffer.set_buffer(reply.buffer());
        aclnn::v1::Empty empty;
        stub().FreeBuffer(context().get(), buffer, &empty);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtMalloc: no device address range left in this process");
    }
    keep_alive();
    *devPtr = reinterpret_cast<void *>(start);
    return ACL_SUCCESS;
}

aclError aclrtFree(void *devPtr)
{
    if (!devPtr) return ACL_SUCCESS;
    auto start = reinterpret_cast<uintptr_t>(devPtr);
    aclnn::v1::BufferRef request;
    if (!address_space().starts(start, request.mutable_buffer()))
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtFree: not the start of a device allocation");
    aclnn::v1::Empty reply;
    grpc::Status status = stub().FreeBuffer(context().get(), request, &reply);
    // Forgotten once the server let go of it (or knows it no more); a free that never reached the server
    // leaves the pointer allocated, for the program to free again (forgotten, its buffer stayed held).
    // Only the allocation it named: a double free racing with an aclrtMalloc that reused the address
    // would otherwise forget the new allocation (its buffer then held on the server for good).
    if (status.ok() || rpc_failure(status) == ACLNN_ERR_PARAM_INVALID) address_space().release(start, request.buffer());
    return status.ok() ? ACL_SUCCESS : runtime_failure(status);
}

aclError aclrtMallocHost(void **hostPtr, size_t size)
{
    if (!hostPtr || size == 0) return fail(ACL_ERROR_INVALID_PARAM, "aclrtMallocHost: hostPtr is null or size 0");
    if (size > SIZE_MAX - 63)  // rounded up to 64 bytes, it would wrap to a block of none
        return fail(ACL_ERROR_BAD_ALLOC, "aclrtMallocHost: " + std::to_string(size) + " bytes is more than memory");
    void *block = std::aligned_alloc(64, (size + 63) / 64 * 64);
    if (!block) return fail(ACL_ERROR_BAD_ALLOC, "aclrtMallocHost: out of host memory");
    host_blocks().add(block);
    *hostPtr = block;
    return ACL_SUCCESS;
}

aclError aclrtFreeHost(void *hostPtr)
{
    if (!hostPtr) return fail(ACL_ERROR_INVALID_PARAM, "aclrtFreeHost: hostPtr is null");
    // Only what aclrtMallocHost gave, once: freeing a device pointer, a pointer into a block or a block
    // twice was the C library's free of it (a crash, or a heap corrupted).
    if (!host_blocks().remove(hostPtr))
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtFreeHost: not a block from aclrtMallocHost (or freed already)");
    std::free(hostPtr);
    return ACL_SUCCESS;
}

aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind)
{
    if (count > destMax)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtMemcpy: count " + std::to_string(count) + " > destMax " +
                                                 std::to_string(destMax));
    DeviceRef dst_ref, src_ref;
    aclError code;
    switch (direction(kind, dst, src)) {
    case ACL_MEMCPY_HOST_TO_HOST:
        if ((code = host_range(dst, count, "aclrtMemcpy dst")) || (code = host_range(src, count, "aclrtMemcpy src")))
            return code;
        if (count) std::memmove(dst, src, count);
        return ACL_SUCCESS;
    case ACL_MEMCPY_HOST_TO_DEVICE:
        if ((code = device_range(dst, count, "aclrtMemcpy dst", &dst_ref)) ||
            (code = host_range(src, count, "aclrtMemcpy src")))
            return code;
        return write(dst_ref, src, count);
    case ACL_MEMCPY_DEVICE_TO_HOST:
        if ((code = host_range(dst, count, "aclrtMemcpy dst")) ||
            (code = device_range(src, count, "aclrtMemcpy src", &src_ref)))
            return code;
        return read(dst, src_ref, count);
    case ACL_MEMCPY_DEVICE_TO_DEVICE: {
        if ((code = device_range(dst, count, "aclrtMemcpy dst", &dst_ref)) ||
            (code = device_range(src, count, "aclrtMemcpy src", &src_ref)))
            return code;
        aclnn::v1::BufferCopy request;
        request.mutable_dst()->set_buffer(dst_ref.buffer);
        request.mutable_dst()->set_offset(dst_ref.offset);
        request.mutable_src()->set_buffer(src_ref.buffer);
        request.mutable_src()->set_offset(src_ref.offset);
        request.set_size(count);
        aclnn::v1::Empty reply;
        grpc::Status status = stub().CopyBuffer(context().get(), request, &reply);
        return status.ok() ? ACL_SUCCESS : runtime_failure(status);
    }
    default:
        break;
    }
    return fail(ACL_ERROR_INVALID_PARAM, "aclrtMemcpy: unknown kind " + std::to_string(kind));
}

// Ordered after the stream's queued calls by waiting for them: the copy itself is then synchronous.
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream)
{
    int64_t id = stream_id(stream);
    if (id < 0) return not_a_stream("aclrtMemcpyAsync");
    aclError code = drain(id);
    return code ? code : aclrtMemcpy(dst, destMax, src, count, kind);
}

aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count)
{
    if (count > maxCount)
        return fail(ACL_ERROR_INVALID_PARAM, "aclrtMemset: count " + std::to_string(count) + " > maxCount " +
                                                 std::to_string(maxCount));
    DeviceRef ref;
    if (aclError code = device_range(devPtr, count, "aclrtMemset devPtr", &ref)) return code;
    aclnn::v1::BufferFill request;
    request.mutable_dst()->set_buffer(ref.buffer);
    request.mutable_dst()->set_offset(ref.offset);
    request.set_size(count);
    request.set_value(static_cast<uint32_t>(value) & 0xff);
    aclnn::v1::Empty reply;
    grpc::Status status = stub().FillBuffer(context().get(), request, &reply);
    return status.ok() ? ACL_SUCCESS : runtime_failure(status);
}

aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream)
{
    int64_t id = stream_id(stream);
    if (id < 0) return not_a_stream("aclrtMemsetAsync");
    aclError code = drain(id);
    return code ? code : aclrtMemset(devPtr, maxCount, value, count);
}

}  // extern "C"
