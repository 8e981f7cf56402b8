// Compiles only when these functions have CANN's own types, as its op_api headers declare them (const
// outputs for RmsNorm and RmsNormGrad, non-const mean/invstd/counter for the Elemt pair): a program
// written against CANN's, passing const outputs or holding a function pointer, compiles here unchanged.
#include <cstdio>
#include <type_traits>

#include "aclnnop/aclnn_batch_norm_elemt.h"
#include "aclnnop/aclnn_batch_norm_elemt_backward.h"
#include "aclnnop/aclnn_rms_norm.h"
#include "aclnnop/aclnn_rms_norm_grad.h"

using RmsNorm = aclnnStatus(const aclTensor *, const aclTensor *, double, const aclTensor *, const aclTensor *,
                            uint64_t *, aclOpExecutor **);
using RmsNormGrad = aclnnStatus(const aclTensor *, const aclTensor *, const aclTensor *, const aclTensor *,
                                const aclTensor *, const aclTensor *, uint64_t *, aclOpExecutor **);
using Elemt = aclnnStatus(const aclTensor *, const aclTensor *, const aclTensor *, aclTensor *, aclTensor *, double,
                          aclTensor *, uint64_t *, aclOpExecutor **);
using ElemtBackward = aclnnStatus(const aclTensor *, const aclTensor *, const aclTensor *, const aclTensor *,
                                  const aclTensor *, const aclTensor *, const aclTensor *, aclTensor *, aclTensor *,
                                  uint64_t *, aclOpExecutor **);
static_assert(std::is_same_v<decltype(aclnnRmsNormGetWorkspaceSize), RmsNorm>);
static_assert(std::is_same_v<decltype(aclnnRmsNormGradGetWorkspaceSize), RmsNormGrad>);
static_assert(std::is_same_v<decltype(aclnnBatchNormElemtGetWorkspaceSize), Elemt>);
static_assert(std::is_same_v<decltype(aclnnBatchNormElemtBackwardGetWorkspaceSize), ElemtBackward>);

int main()
{
    std::printf("CANN's types\n");
    return 0;
}
