// libnnopbase: the argument objects (aclTensor, arrays). They only describe: nothing here talks to the server.
#include <new>

#include "objects.h"

extern "C" {

aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t *stride,
                           int64_t offset, aclFormat format, const int64_t *storageDims, uint64_t storageDimsNum,
                           void *tensorData)
{
    if ((viewDimsNum && !viewDims) || (storageDimsNum && !storageDims) || viewDimsNum > 64 || storageDimsNum > 64) {
        return nullptr;  // what the server would refuse anyway, and nothing to copy from
    }
    auto *tensor = new (std::nothrow) aclTensor;
    if (!tensor) return nullptr;
    tensor->view_dims.assign(viewDims, viewDims + viewDimsNum);
    tensor->storage_dims.assign(storageDims, storageDims + storageDimsNum);
    if (stride) {
        tensor->strides.assign(stride, stride + viewDimsNum);
    } else {  // contiguous, as CANN assumes without strides
        tensor->strides.assign(viewDimsNum, 1);
        for (int64_t i = static_cast<int64_t>(viewDimsNum) - 2; i >= 0; i--)
            tensor->strides[i] = tensor->strides[i + 1] * viewDims[i + 1];
    }
    tensor->offset = offset;
    tensor->data_type = dataType;
    tensor->format = format;
    tensor->data = tensorData;
    return tensor;
}

aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size)
{
    if (size && !value) return nullptr;
    auto *array = new (std::nothrow) aclIntArray;
    if (array) array->values.assign(value, value + size);
    return array;
}

aclFloatArray *aclCreateFloatArray(const float *value, uint64_t size)
{
    if (size && !value) return nullptr;
    auto *array = new (std::nothrow) aclFloatArray;
    if (array) array->values.assign(value, value + size);
    return array;
}

aclBoolArray *aclCreateBoolArray(const bool *value, uint64_t size)
{
    if (size && !value) return nullptr;
    auto *array = new (std::nothrow) aclBoolArray;
    if (array) array->values.assign(value, value + size);
    return array;
}

aclnnStatus aclDestroyTensor(const aclTensor *tensor)
{
    delete tensor;  // a call already queued keeps what it sent: the server has its own copy
    return ACLNN_SUCCESS;
}

aclnnStatus aclDestroyIntArray(const aclIntArray *array)
{
    delete array;
    return ACLNN_SUCCESS;
}

aclnnStatus aclDestroyFloatArray(const aclFloatArray *array)
{
    delete array;
    return ACLNN_SUCCESS;
}

aclnnStatus aclDestroyBoolArray(const aclBoolArray *array)
{
    delete array;
    return ACLNN_SUCCESS;
}

}  // extern "C"
