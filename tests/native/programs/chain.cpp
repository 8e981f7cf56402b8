// A chain of LayerNorm forward + backward calls on device memory, on one or several streams.
//
//   chain DIR DTYPE STREAMS ITERATIONS [threads]
//
// Reads DIR/shape (rows cols), DIR/x.bin and DIR/dy.bin (rows*cols elements of DTYPE: 0 float,
// 1 float16, 27 bfloat16). Everything lives in ONE aclrtMalloc allocation, each tensor at a pointer
// offset into it. Stream s runs ITERATIONS steps of: y, mean, rstd = LayerNorm(x); dx, dw, db =
// LayerNormBackward(dy, x, mean, rstd); x = y (the next step reads this step's output, so the
// stream's order matters). Stream 1 reads x through a transposed storage (strided aclCreateTensor
// views), stream 0 contiguously. With `threads`, each stream's steps are issued by a thread of its
// own, all at once. Writes DIR/out<s>.bin: y, dx (DTYPE), dw, db (float).
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_layer_norm.h"
#include "aclnnop/aclnn_layer_norm_backward.h"
#include "check.h"

static std::vector<char> read_file(const std::string &path)
{
    std::ifstream in(path, std::ios::binary);
    return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

int main(int argc, char **argv)
{
    if (argc != 5 && !(argc == 6 && std::string(argv[5]) == "threads")) return 2;
    bool threaded = argc == 6;
    std::string dir = argv[1];
    auto dtype = static_cast<aclDataType>(std::atoi(argv[2]));
    int streams = std::atoi(argv[3]), iterations = std::atoi(argv[4]);
    int64_t rows = 0, cols = 0;
    std::ifstream(dir + "/shape") >> rows >> cols;
    size_t item = dtype == ACL_FLOAT ? 4 : 2, n = rows * cols;
    std::vector<char> x = read_file(dir + "/x.bin"), dy = read_file(dir + "/dy.bin");
    if (x.size() != n * item || dy.size() != n * item) return 3;

    CHECK(aclInit(nullptr));
    CHECK(aclrtSetDevice(0));
    // Per stream: x, y0, y1, dy, dx (n items each), mean, rstd (rows floats), w, b, dw, db (cols floats).
    size_t per_stream = 5 * n * item + 2 * rows * 4 + 4 * cols * 4;
    char *base = nullptr;
    CHECK(aclrtMalloc(reinterpret_cast<void **>(&base), per_stream * streams, ACL_MEM_MALLOC_HUGE_FIRST));
    std::vector<float> ones(cols, 1.0f), zeros(cols, 0.0f);
    std::vector<aclrtStream> handles(streams);
    struct Slots { char *x, *y[2], *dy, *dx, *mean, *rstd, *w, *b, *dw, *db; };
    std::vector<Slots> slots(streams);
    for (int s = 0; s < streams; s++) {
        CHECK(aclrtCreateStream(&handles[s]));
        Slots &t = slots[s];
        t.x = base + s * per_stream;  // pointer arithmetic inside one allocation
        t.y[0] = t.x + n * item; t.y[1] = t.y[0] + n * item; t.dy = t.y[1] + n * item; t.dx = t.dy + n * item;
        t.mean = t.dx + n * item; t.rstd = t.mean + rows * 4; t.w = t.rstd + rows * 4;
        t.b = t.w + cols * 4; t.dw = t.b + cols * 4; t.db = t.dw + cols * 4;
        if (s == 1) {  // x stored transposed ([cols, rows] row-major): the view reads it with strides
            std::vector<char> xt(n * item);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++) std::memcpy(&xt[(c * rows + r) * item], &x[(r * cols + c) * item], item);
            CHECK(aclrtMemcpy(t.x, n * item, xt.data(), n * item, ACL_MEMCPY_HOST_TO_DEVICE));
        } else {
            CHECK(aclrtMemcpy(t.x, n * item, x.data(), n * item, ACL_MEMCPY_HOST_TO_DEVICE));
        }
        CHECK(aclrtMemcpy(t.dy, n * item, dy.data(), n * item, ACL_MEMCPY_HOST_TO_DEVICE));
        CHECK(aclrtMemcpy(t.w, cols * 4, ones.data(), cols * 4, ACL_MEMCPY_HOST_TO_DEVICE));
        CHECK(aclrtMemcpy(t.b, cols * 4, zeros.data(), cols * 4, ACL_MEMCPY_HOST_TO_DEVICE));
    }

    std::vector<int64_t> shape = {rows, cols}, contiguous = {cols, 1}, transposed = {1, rows};
    std::vector<int64_t> stats = {rows, 1}, stats_strides = {1, 1}, vec = {cols}, unit = {1};
    std::vector<int64_t> storage_t = {cols, rows};
    int64_t norm_dims[1] = {cols};
    bool mask_data[3] = {true, true, true};
    aclIntArray *norm = aclCreateIntArray(norm_dims, 1);
    aclBoolArray *mask = aclCreateBoolArray(mask_data, 3);
    // One step of stream s: LayerNorm then its backward, queued; 0, or 1 after printing what failed.
    auto step = [&](int s, int i) -> int {
        Slots &t = slots[s];
        bool strided = s == 1 && i == 0;  // afterwards x is the previous step's y, contiguous
        char *input = i == 0 ? t.x : t.y[(i + 1) % 2], *out = t.y[i % 2];
        aclTensor *x_t = strided ? aclCreateTensor(shape.data(), 2, dtype, transposed.data(), 0, ACL_FORMAT_ND,
                                                   storage_t.data(), 2, input)
                                 : aclCreateTensor(shape.data(), 2, dtype, contiguous.data(), 0, ACL_FORMAT_ND,
                                                   shape.data(), 2, input);
        aclTensor *y_t = aclCreateTensor(shape.data(), 2, dtype, contiguous.data(), 0, ACL_FORMAT_ND, shape.data(), 2, out);
        aclTensor *mean_t = aclCreateTensor(stats.data(), 2, ACL_FLOAT, stats_strides.data(), 0, ACL_FORMAT_ND, stats.data(), 2, t.mean);
        aclTensor *rstd_t = aclCreateTensor(stats.data(), 2, ACL_FLOAT, stats_strides.data(), 0, ACL_FORMAT_ND, stats.data(), 2, t.rstd);
        aclTensor *w_t = aclCreateTensor(vec.data(), 1, ACL_FLOAT, unit.data(), 0, ACL_FORMAT_ND, vec.data(), 1, t.w);
        aclTensor *b_t = aclCreateTensor(vec.data(), 1, ACL_FLOAT, unit.data(), 0, ACL_FORMAT_ND, vec.data(), 1, t.b);
        uint64_t workspace = 0;
        aclOpExecutor *executor = nullptr;
        CHECK(aclnnLayerNormGetWorkspaceSize(x_t, norm, w_t, b_t, 1e-5, y_t, mean_t, rstd_t, &workspace, &executor));
        CHECK(aclnnLayerNorm(nullptr, workspace, executor, handles[s]));
        aclTensor *dy_t = aclCreateTensor(shape.data(), 2, dtype, contiguous.data(), 0, ACL_FORMAT_ND, shape.data(), 2, t.dy);
        aclTensor *dx_t = aclCreateTensor(shape.data(), 2, dtype, contiguous.data(), 0, ACL_FORMAT_ND, shape.data(), 2, t.dx);
        aclTensor *dw_t = aclCreateTensor(vec.data(), 1, ACL_FLOAT, unit.data(), 0, ACL_FORMAT_ND, vec.data(), 1, t.dw);
        aclTensor *db_t = aclCreateTensor(vec.data(), 1, ACL_FLOAT, unit.data(), 0, ACL_FORMAT_ND, vec.data(), 1, t.db);
        CHECK(aclnnLayerNormBackwardGetWorkspaceSize(dy_t, x_t, norm, mean_t, rstd_t, w_t, b_t, mask, dx_t, dw_t, db_t,
                                                     &workspace, &executor));
        CHECK(aclnnLayerNormBackward(nullptr, workspace, executor, handles[s]));
        // Destroyed right after queueing: the queued calls keep what they need.
        for (aclTensor *tensor : {x_t, y_t, mean_t, rstd_t, w_t, b_t, dy_t, dx_t, dw_t, db_t}) aclDestroyTensor(tensor);
        return 0;
    };
    if (threaded) {
        std::atomic<int> failed{0};
        std::vector<std::thread> issuers;
        for (int s = 0; s < streams; s++)
            issuers.emplace_back([&, s] {
                for (int i = 0; i < iterations && !failed; i++) failed += step(s, i);
            });
        for (auto &issuer : issuers) issuer.join();
        if (failed) return 1;
    } else {
        for (int i = 0; i < iterations; i++)
            for (int s = 0; s < streams; s++) CHECK(step(s, i));
    }
    for (int s = 0; s < streams; s++) {
        CHECK(aclrtSynchronizeStream(handles[s]));
        Slots &t = slots[s];
        std::vector<char> y(n * item), dx(n * item), dw(cols * 4), db(cols * 4);
        CHECK(aclrtMemcpy(y.data(), y.size(), t.y[(iterations + 1) % 2], y.size(), ACL_MEMCPY_DEVICE_TO_HOST));
        CHECK(aclrtMemcpy(dx.data(), dx.size(), t.dx, dx.size(), ACL_MEMCPY_DEVICE_TO_HOST));
        CHECK(aclrtMemcpy(dw.data(), dw.size(), t.dw, dw.size(), ACL_MEMCPY_DEVICE_TO_HOST));
        CHECK(aclrtMemcpy(db.data(), db.size(), t.db, db.size(), ACL_MEMCPY_DEVICE_TO_HOST));
        std::ofstream out(dir + "/out" + std::to_string(s) + ".bin", std::ios::binary);
        for (auto *part : {&y, &dx, &dw, &db}) out.write(part->data(), part->size());
        CHECK(aclrtDestroyStream(handles[s]));
    }
    aclDestroyIntArray(norm);
    aclDestroyBoolArray(mask);
    CHECK(aclrtFree(base));
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    return 0;
}
