#include <gtest/gtest.h>
#include "core/rng.h"
TEST(Rng, Deterministic) { hax::Rng a(1), b(1); EXPECT_EQ(a.next(), b.next()); }
