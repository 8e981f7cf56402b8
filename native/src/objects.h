// The argument objects behind the opaque CANN handles (libnnopbase), read by the operators (libopapi).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "aclnn/acl_meta.h"

struct aclTensor {
    std::vector<int64_t> view_dims, strides, storage_dims;
    int64_t offset = 0;
    aclDataType data_type = ACL_FLOAT;
    aclFormat format = ACL_FORMAT_ND;
    void *data = nullptr;  // device memory (a pointer into an aclrtMalloc allocation), or null
};

struct aclScalar {
    aclDataType data_type = ACL_FLOAT;
    std::vector<unsigned char> bytes;  // the value, as given
};

struct aclIntArray {
    std::vector<int64_t> values;
};

struct aclFloatArray {
    std::vector<float> values;
};

struct aclBoolArray {
    std::vector<bool> values;
};

