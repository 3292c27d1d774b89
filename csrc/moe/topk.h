// Top-k expert choices per token: the k largest gate scores of each row, largest first.
#pragma once

#include <cstdint>

namespace dnv::moe {

// scores[tokens, experts] (row-major float32) -> index[tokens, k], value[tokens, k]. Ties go to the lower
// expert index (as torch.argmax and a stable descending sort choose), so k=1 is argmax. Parallel over tokens;
// throws std::invalid_argument for a NaN score or k outside [1, experts].
void top_k(const float* scores, int64_t tokens, int64_t experts, int64_t k, int64_t* index, float* value);

}  // namespace dnv::moe
