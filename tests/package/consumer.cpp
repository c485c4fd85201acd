// A consumer of the tessel package: includes the umbrella header and checks a few facts that need
// the number types, so a broken install (missing header, wrong include path) fails here.
#include <tessel/tessel.hpp>

#include <cstdio>

int main() {
  const tessel::bf16 one(1.0f);
  const tessel::e4m3 big(448.0f);
  if (one.bits() != 0x3F80 || static_cast<float>(big) != 448.0f) {
    std::puts("tessel package consumer: wrong values");
    return 1;
  }
  std::puts("tessel package consumer: ok");
  return 0;
}
