// train_loop: the pinfeed Loader inside a training program's own loop.
// A softmax-regression classifier on 8x8-pooled images, trained with plain
// SGD, to show the loop a user writes: epochs, batches, labels, state.
//
//   train_loop DATASET_DIR [EPOCHS]
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/loader.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: train_loop DATASET_DIR [EPOCHS]\n");
    return 2;
  }
  try {
    pinfeed::loader::LoaderConfig config;
    config.dataset = argv[1];
    config.batch_size = 32;
    config.transform.size = 32;  // 32x32 crops, float32 NCHW, normalized
    config.seed = 1;
    pinfeed::loader::Loader loader(config);
    const int epochs = argc > 2 ? std::stoi(argv[2]) : 3;
    const int classes = static_cast<int>(loader.dataset().num_classes());
    constexpr int kPool = 4, kSide = 32 / kPool, kFeatures = 3 * kSide * kSide;
    std::vector<float> w(static_cast<std::size_t>(classes * kFeatures), 0.0F),
        b(static_cast<std::size_t>(classes), 0.0F);
    std::vector<float> x(kFeatures), p(static_cast<std::size_t>(classes));

    for (int epoch = 0; epoch < epochs; ++epoch) {
      loader.begin_epoch(static_cast<std::uint64_t>(epoch));  // shuffling and augmentation of this epoch
      double loss = 0;
      std::size_t correct = 0, seen = 0;
      for (pinfeed::loader::Batch& batch : loader) {
        const auto* images = reinterpret_cast<const float*>(batch.data().data());
        const std::size_t n = batch.size();
        std::vector<float> gw(w.size(), 0.0F), gb(b.size(), 0.0F);
        for (std::size_t i = 0; i < n; ++i) {
          const float* img = images + i * 3 * 32 * 32;
          for (int c = 0; c < 3; ++c) {  // 4x4 average pooling
            for (int y = 0; y < kSide; ++y) {
              for (int xx = 0; xx < kSide; ++xx) {
                float s = 0;
                for (int dy = 0; dy < kPool; ++dy) {
                  for (int dx = 0; dx < kPool; ++dx) s += img[(c * 32 + y * kPool + dy) * 32 + xx * kPool + dx];
                }
                x[static_cast<std::size_t>((c * kSide + y) * kSide + xx)] = s / (kPool * kPool);
              }
            }
          }
          float top = -1e30F;
          int best = 0;
          for (int k = 0; k < classes; ++k) {
            float z = b[static_cast<std::size_t>(k)];
            for (int f = 0; f < kFeatures; ++f)
              z += w[static_cast<std::size_t>(k * kFeatures + f)] * x[static_cast<std::size_t>(f)];
            p[static_cast<std::size_t>(k)] = z;
            if (z > top) top = z, best = k;
          }
          double sum = 0;
          for (auto& v : p) sum += std::exp(static_cast<double>(v - top));
          const auto label = static_cast<int>(batch.labels()[i]);
          loss += std::log(sum) - static_cast<double>(p[static_cast<std::size_t>(label)] - top);
          correct += best == label ? 1 : 0;
          for (int k = 0; k < classes; ++k) {
            const float g =
                static_cast<float>(std::exp(static_cast<double>(p[static_cast<std::size_t>(k)] - top)) / sum) -
                (k == label ? 1.0F : 0.0F);
            gb[static_cast<std::size_t>(k)] += g;
            for (int f = 0; f < kFeatures; ++f)
              gw[static_cast<std::size_t>(k * kFeatures + f)] += g * x[static_cast<std::size_t>(f)];
          }
        }
        const float lr = 0.05F / static_cast<float>(n);
        for (std::size_t j = 0; j < w.size(); ++j) w[j] -= lr * gw[j];
        for (std::size_t j = 0; j < b.size(); ++j) b[j] -= lr * gb[j];
        seen += n;
      }  // each batch's slot goes back to the pool when the loop moves on
      const auto stats = loader.stats();
      std::printf("epoch %d: loss %.4f  accuracy %.1f%%  %.0f images/s  %llu pinned / %llu pageable batches\n",
                  epoch + 1, loss / static_cast<double>(seen),
                  100.0 * static_cast<double>(correct) / static_cast<double>(seen), stats.images_per_second,
                  static_cast<unsigned long long>(stats.pinned_batches),
                  static_cast<unsigned long long>(stats.pageable_batches));
    }
    return 0;
  } catch (const pinfeed::Error& e) {
    std::fprintf(stderr, "train_loop: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_loop: %s\n", e.what());
    return 1;
  }
}
