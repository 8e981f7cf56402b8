// Operators whose parameters are of every C kind the API has: int64_t (GroupNorm's N, C, HxW,
// group), double (eps, momentum), bool (BatchNorm's training, BatchNormReduceBackward's flags),
// aclBoolArray (outputMask), in/out tensors (running statistics) and null optional outputs.
//
//   every_kind DIR
//
// Reads DIR/in.bin (IN_FLOATS float32 values; each op takes its inputs from the front of it, in
// the order of its tensors), runs GroupNorm, GroupNormBackward (mask 1 0 1), BatchNorm (training,
// running statistics updated), BatchNormReduceBackward (inputG, biasG; gradWeight null) and RmsNorm
// on one stream, and writes each result as DIR/<op>.<param>.bin (raw float32).
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_batch_norm.h"
#include "aclnnop/aclnn_batch_norm_backward_reduce.h"  // CANN's name for it
#include "aclnnop/aclnn_group_norm.h"
#include "aclnnop/aclnn_group_norm_backward.h"
#include "aclnnop/aclnn_rms_norm.h"
#include "check.h"

static const size_t IN_FLOATS = 64;

// A float32 tensor in device memory, filled from the host (or with `fill`), and its results read back.
struct Device {
    std::vector<int64_t> shape;
    void *addr = nullptr;
    aclTensor *tensor = nullptr;
    size_t count() const
    {
        size_t n = 1;
        for (int64_t d : shape) n *= d;
        return n;
    }
};

static int make(Device &t, std::vector<int64_t> shape, const float *values)
{
    t.shape = shape;
    size_t bytes = t.count() * sizeof(float);
    CHECK(aclrtMalloc(&t.addr, bytes, ACL_MEM_MALLOC_HUGE_FIRST));
    CHECK(aclrtMemcpy(t.addr, bytes, values, bytes, ACL_MEMCPY_HOST_TO_DEVICE));
    std::vector<int64_t> strides(shape.size(), 1);
    for (int i = static_cast<int>(shape.size()) - 2; i >= 0; i--) strides[i] = strides[i + 1] * shape[i + 1];
    t.tensor = aclCreateTensor(shape.data(), shape.size(), ACL_FLOAT, strides.data(), 0, ACL_FORMAT_ND, shape.data(),
                               shape.size(), t.addr);
    return t.tensor == nullptr;
}

static int save(const std::string &dir, const std::string &name, const Device &t)
{
    std::vector<float> host(t.count());
    size_t bytes = host.size() * sizeof(float);
    CHECK(aclrtMemcpy(host.data(), bytes, t.addr, bytes, ACL_MEMCPY_DEVICE_TO_HOST));
    std::ofstream(dir + "/" + name + ".bin", std::ios::binary).write(reinterpret_cast<char *>(host.data()), bytes);
    return 0;
}

// Runs an executor planned by a GetWorkspaceSize call, with its workspace, on `stream`.
template <typename Run>
static int launch(uint64_t size, aclOpExecutor *executor, aclrtStream stream, Run run)
{
    void *workspace = nullptr;
    if (size > 0) CHECK(aclrtMalloc(&workspace, size, ACL_MEM_MALLOC_HUGE_FIRST));
    CHECK(run(workspace, size, executor, stream));
    CHECK(aclrtSynchronizeStream(stream));
    if (workspace != nullptr) CHECK(aclrtFree(workspace));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) return 2;
    std::string dir = argv[1];
    std::vector<float> in(IN_FLOATS);
    std::ifstream file(dir + "/in.bin", std::ios::binary);
    if (!file.read(reinterpret_cast<char *>(in.data()), IN_FLOATS * sizeof(float))) return 3;
    const float *v = in.data();
    std::vector<float> zeros(IN_FLOATS, 0.0f), ones(IN_FLOATS, 1.0f);

    CHECK(aclInit(nullptr));
    CHECK(aclrtSetDevice(0));
    aclrtStream stream;
    CHECK(aclrtCreateStream(&stream));
    uint64_t size = 0;
    aclOpExecutor *executor = nullptr;

    // GroupNorm: self [2, 4, 3], gamma and beta [4]; N 2, C 4, HxW 3, 2 groups.
    const int64_t N = 2, C = 4, HxW = 3, group = 2;
    Device self, gamma, beta, out, mean, rstd;
    CHECK(make(self, {N, C, HxW}, v) || make(gamma, {C}, v + 24) || make(beta, {C}, v + 28));
    CHECK(make(out, {N, C, HxW}, zeros.data()) || make(mean, {N, group}, zeros.data()) ||
          make(rstd, {N, group}, zeros.data()));
    CHECK(aclnnGroupNormGetWorkspaceSize(self.tensor, gamma.tensor, beta.tensor, N, C, HxW, group, 1e-5, out.tensor,
                                         mean.tensor, rstd.tensor, &size, &executor));
    CHECK(launch(size, executor, stream, aclnnGroupNorm));
    CHECK(save(dir, "group_norm.out", out) || save(dir, "group_norm.meanOut", mean) ||
          save(dir, "group_norm.rstdOut", rstd));

    // GroupNormBackward on those statistics, gradOut from in.bin; gradGammaOut masked off (null).
    Device grad_out, grad_input, grad_beta;
    CHECK(make(grad_out, {N, C, HxW}, v + 32) || make(grad_input, {N, C, HxW}, zeros.data()) ||
          make(grad_beta, {C}, zeros.data()));
    bool mask[3] = {true, false, true};
    aclBoolArray *output_mask = aclCreateBoolArray(mask, 3);
    CHECK(aclnnGroupNormBackwardGetWorkspaceSize(grad_out.tensor, self.tensor, mean.tensor, rstd.tensor, gamma.tensor,
                                                 N, C, HxW, group, output_mask, grad_input.tensor, nullptr,
                                                 grad_beta.tensor, &size, &executor));
    CHECK(launch(size, executor, stream, aclnnGroupNormBackward));
    CHECK(save(dir, "group_norm_backward.gradInput", grad_input) ||
          save(dir, "group_norm_backward.gradBetaOut", grad_beta));

    // BatchNorm, training: input [3, 2, 2] (channel axis 1), running statistics 0 and 1 updated with
    // momentum 0.25.
    Device input, weight, bias, running_mean, running_var, output, save_mean, save_invstd;
    CHECK(make(input, {3, 2, 2}, v) || make(weight, {2}, v + 24) || make(bias, {2}, v + 28));
    CHECK(make(running_mean, {2}, zeros.data()) || make(running_var, {2}, ones.data()));
    CHECK(make(output, {3, 2, 2}, zeros.data()) || make(save_mean, {2}, zeros.data()) ||
          make(save_invstd, {2}, zeros.data()));
    CHECK(aclnnBatchNormGetWorkspaceSize(input.tensor, weight.tensor, bias.tensor, running_mean.tensor,
                                         running_var.tensor, true, 0.25, 1e-5, output.tensor, save_mean.tensor,
                                         save_invstd.tensor, &size, &executor));
    CHECK(launch(size, executor, stream, aclnnBatchNorm));
    CHECK(save(dir, "batch_norm.output", output) || save(dir, "batch_norm.saveMean", save_mean) ||
          save(dir, "batch_norm.saveInvstd", save_invstd) || save(dir, "batch_norm.runningMean", running_mean) ||
          save(dir, "batch_norm.runningVar", running_var));

    // BatchNormReduceBackward on that batch's statistics: inputG and biasG, not weightG.
    Device dy, sum_dy, sum_dy_xmu, grad_bias;
    CHECK(make(dy, {3, 2, 2}, v + 32) || make(sum_dy, {2}, zeros.data()) || make(sum_dy_xmu, {2}, zeros.data()) ||
          make(grad_bias, {2}, zeros.data()));
    CHECK(aclnnBatchNormReduceBackwardGetWorkspaceSize(dy.tensor, input.tensor, save_mean.tensor, save_invstd.tensor,
                                                       weight.tensor, true, false, true, sum_dy.tensor,
                                                       sum_dy_xmu.tensor, nullptr, grad_bias.tensor, &size,
                                                       &executor));
    CHECK(launch(size, executor, stream, aclnnBatchNormReduceBackward));
    CHECK(save(dir, "batch_norm_reduce_backward.sumDy", sum_dy) ||
          save(dir, "batch_norm_reduce_backward.sumDyXmu", sum_dy_xmu) ||
          save(dir, "batch_norm_reduce_backward.gradBias", grad_bias));

    // RmsNorm: x [3, 4], gamma [4], epsilon 1e-6; rstdOut [3, 1].
    Device x, rms_gamma, y, rms_rstd;
    CHECK(make(x, {3, 4}, v) || make(rms_gamma, {4}, v + 24) || make(y, {3, 4}, zeros.data()) ||
          make(rms_rstd, {3, 1}, zeros.data()));
    CHECK(aclnnRmsNormGetWorkspaceSize(x.tensor, rms_gamma.tensor, 1e-6, y.tensor, rms_rstd.tensor, &size, &executor));
    CHECK(launch(size, executor, stream, aclnnRmsNorm));
    CHECK(save(dir, "rms_norm.yOut", y) || save(dir, "rms_norm.rstdOut", rms_rstd));

    CHECK(aclrtDestroyStream(stream));
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    return 0;
}
