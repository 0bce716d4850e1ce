// Per-group int8 quantisation of activation rows (see activation_quant.h).
#include "activation_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace hm {

void quantize_row(const float* x, int64_t k, int64_t padded, int group, int8_t* q, float* scale, float* qsum) {
  for (int64_t g = 0; g * group < padded; ++g) {
    const int64_t begin = g * group, end = std::min<int64_t>(begin + group, k);
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = begin; i < end; ++i) {
      finite &= std::isfinite(x[i]);
      amax = std::max(amax, std::fabs(x[i]));
    }
    int8_t* qg = q + begin;
    std::memset(qg, 0, static_cast<size_t>(group));
    if (!finite) {
      scale[g] = NAN;
      qsum[g] = NAN;
      continue;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int64_t i = begin; i < end; ++i) {
      const float v = std::nearbyint(x[i] * inv);
      const int qi = static_cast<int>(std::min(127.0f, std::max(-127.0f, v)));
      qg[i - begin] = static_cast<int8_t>(qi);
      sum += qi;
    }
    scale[g] = amax / 127.0f;
    qsum[g] = scale[g] * static_cast<float>(sum);
  }
}

}  // namespace hm
