#include "router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace hm {
namespace {

// The k largest of v [n] (indices, descending; ties: the lower index first) into out.
void top_k(const float* v, int64_t n, int k, int64_t* out, std::vector<int64_t>& order) {
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  std::copy(order.begin(), order.begin() + k, out);
}

}  // namespace

void route(const RouteArgs& a) {
  const int64_t E = a.experts;
  std::vector<float> scores(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  std::vector<float> group_score(static_cast<size_t>(a.groups));
  std::vector<int64_t> order, kept_groups(static_cast<size_t>(a.topk_groups));
  std::vector<char> keep(static_cast<size_t>(a.groups));  // per token: whether each group's experts stay
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* x = a.logits + t * a.logits_stride;
    if (a.sigmoid) {
      for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-x[e]));
    } else {
      const float m = *std::max_element(x, x + E);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += scores[e] = std::exp(x[e] - m);
      const float inv = 1.0f / sum;
      for (int64_t e = 0; e < E; ++e) scores[e] *= inv;
    }
    for (int64_t e = 0; e < E; ++e) choice[e] = a.bias ? scores[e] + a.bias[e] : scores[e];
    if (a.groups > 1) {  // each group's top-2 sum; experts outside the best topk_groups groups are out
      const int64_t per = E / a.groups;
      for (int g = 0; g < a.groups; ++g) {
        float first = neg_inf, second = neg_inf;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
          const float c = choice[e];
          if (c > first) second = first, first = c;
          else if (c > second) second = c;
        }
        group_score[g] = first + second;
      }
      top_k(group_score.data(), a.groups, a.topk_groups, kept_groups.data(), order);
      std::fill(keep.begin(), keep.end(), 0);
      for (int64_t g : kept_groups) keep[static_cast<size_t>(g)] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[static_cast<size_t>(e / per)]) choice[e] = neg_inf;
    }
    int64_t* ids = a.ids + t * a.k;
    float* w = a.weights + t * a.k;
    top_k(choice.data(), E, a.k, ids, order);
    float sum = 0.0f;
    for (int j = 0; j < a.k; ++j) sum += w[j] = scores[ids[j]];
    const float denom = sum + a.norm_eps;
    for (int j = 0; j < a.k; ++j) w[j] = (a.normalize ? w[j] / denom : w[j]) * a.scale;
  }
}

}  // namespace hm
