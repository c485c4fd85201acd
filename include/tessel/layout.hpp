// Umbrella for tessel/layout: constexpr tile layouts (row, col, panel, col_panel/vnni2, swizzle).
#pragma once
#include <tessel/layout/layout.hpp>
