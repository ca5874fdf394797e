// A heat map of values in [0, 1] (accuracies) as a self-contained SVG picture: one coloured cell per
// (row, column) with its value printed inside, labelled rows and columns, axis titles, a title and a
// colour bar. Used by `hax eval --lengths --svg` (rows = lengths, columns = needle depths).
#pragma once
#include <string>
#include <vector>

namespace hax {

struct Heatmap {
  std::string title;                // first line above the grid, e.g. "runs/a/best.safetensors (step 4000)"
  std::string subtitle;             // second line (may be empty), e.g. "task niah single: accuracy (%)"
  std::string row_title;            // vertical axis title, e.g. "length (tokens)"
  std::string col_title;            // horizontal axis title, e.g. "needle depth (0 = start, 1 = end)"
  std::vector<std::string> rows;    // (R) row labels, top to bottom, e.g. {"1K", "4K"}
  std::vector<std::string> cols;    // (C) column labels, left to right, e.g. {"0", "0.5", "1"}
  std::vector<double> values;       // (R, C) row-major, in [0, 1]; NaN: no value (a grey cell)
  std::vector<std::string> notes;   // (R, C) row-major cell tooltips, or empty for none
};

// The picture; every cell is one <rect class="cell"> (R * C of them). Throws UsageError when
// `values` (or a non-empty `notes`) does not have rows * cols entries.
std::string heatmap_svg(const Heatmap& map);

// The colour of value v: red (0) through yellow (0.5) to green (1), as "#rrggbb"; grey for NaN.
std::string heatmap_colour(double v);

// `text` with &, <, >, " and ' escaped for XML.
std::string xml_escape(const std::string& text);

}  // namespace hax
