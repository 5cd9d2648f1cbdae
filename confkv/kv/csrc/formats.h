// Storage formats as the kernels know them: the codes of FORMAT_CODES in confkv/kv/paged_attention.py.
#pragma once

#include <cstdint>

enum Format : int64_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt8 = 3, kInt4 = 4, kInt2 = 5, kInt4c = 6 };
