#include "eval/heatmap_svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace hax {

namespace {

// Geometry (pixels).
constexpr int kCellW = 64, kCellH = 32;
constexpr int kTitleH = 56;    // title and subtitle
constexpr int kColLabelH = 22; // column labels above the grid
constexpr int kBottomH = 40;   // column axis title below the grid
constexpr int kBarGap = 24, kBarW = 14, kBarLabelW = 44;
constexpr int kCharW = 7;      // approximate width of one character at font-size 12

struct Rgb {
  double r, g, b;
};

// The colour stops: red, yellow, green (ColorBrewer RdYlGn ends and middle).
constexpr Rgb kStops[3] = {{215, 48, 39}, {254, 224, 139}, {26, 152, 80}};

Rgb colour_of(double v) {
  v = std::clamp(v, 0.0, 1.0);
  const int i = v < 0.5 ? 0 : 1;
  const double f = v < 0.5 ? v / 0.5 : (v - 0.5) / 0.5;
  const Rgb& a = kStops[i];
  const Rgb& b = kStops[i + 1];
  return {a.r + f * (b.r - a.r), a.g + f * (b.g - a.g), a.b + f * (b.b - a.b)};
}

std::string hex(const Rgb& c) {
  auto byte = [](double x) { return (int)std::lround(std::clamp(x, 0.0, 255.0)); };
  return fmt::format("#{:02x}{:02x}{:02x}", byte(c.r), byte(c.g), byte(c.b));
}

// Dark text on light cells, white on dark ones (relative luminance).
const char* text_colour(double v) {
  if (std::isnan(v)) return "#333333";
  const Rgb c = colour_of(v);
  const double lum = (0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b) / 255;
  return lum > 0.45 ? "#1a1a1a" : "#ffffff";
}

int text_width(const std::string& s) { return (int)s.size() * kCharW; }

}  // namespace

std::string heatmap_colour(double v) { return std::isnan(v) ? std::string("#c8c8c8") : hex(colour_of(v)); }

std::string xml_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += ch;
    }
  }
  return out;
}

std::string heatmap_svg(const Heatmap& m) {
  const size_t R = m.rows.size(), C = m.cols.size();
  HAX_CHECK(m.values.size() == R * C, "heat map: {} values for {} rows x {} columns", m.values.size(), R, C);
  HAX_CHECK(m.notes.empty() || m.notes.size() == R * C, "heat map: {} notes for {} rows x {} columns",
            m.notes.size(), R, C);
  int row_label_w = 0;
  for (const auto& r : m.rows) row_label_w = std::max(row_label_w, text_width(r));
  const int left = 28 + row_label_w + 10;  // row axis title (rotated), row labels, gap
  const int top = kTitleH + kColLabelH;
  const int grid_w = (int)C * kCellW, grid_h = (int)R * kCellH;
  const int bar_x = left + grid_w + kBarGap;
  const int title_w = std::max(text_width(m.title) * 15 / 12, text_width(m.subtitle)) + 20;
  const int width = std::max(bar_x + kBarW + kBarLabelW, title_w);
  const int height = top + std::max(grid_h, 60) + kBottomH;

  std::string s;
  s += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s += fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n",
      width, height, width, height);
  s += fmt::format("<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n", width, height);
  s += fmt::format("<text x=\"10\" y=\"22\" font-size=\"15\" font-weight=\"bold\">{}</text>\n", xml_escape(m.title));
  if (!m.subtitle.empty())
    s += fmt::format("<text x=\"10\" y=\"42\" fill=\"#444444\">{}</text>\n", xml_escape(m.subtitle));

  // Column labels above the grid, row labels left of it.
  for (size_t c = 0; c < C; ++c)
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", left + (int)c * kCellW + kCellW / 2,
                     top - 7, xml_escape(m.cols[c]));
  for (size_t r = 0; r < R; ++r)
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n", left - 8,
                     top + (int)r * kCellH + kCellH / 2 + 4, xml_escape(m.rows[r]));

  // Cells.
  for (size_t r = 0; r < R; ++r) {
    for (size_t c = 0; c < C; ++c) {
      const double v = m.values[r * C + c];
      const int x = left + (int)c * kCellW, y = top + (int)r * kCellH;
      const std::string note = m.notes.empty() ? std::string() : m.notes[r * C + c];
      s += fmt::format("<rect class=\"cell\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" "
                       "stroke=\"#ffffff\" stroke-width=\"1\">",
                       x, y, kCellW, kCellH, heatmap_colour(v));
      s += note.empty() ? "</rect>\n" : fmt::format("<title>{}</title></rect>\n", xml_escape(note));
      s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"{}\">{}</text>\n", x + kCellW / 2,
                       y + kCellH / 2 + 4, text_colour(v),
                       std::isnan(v) ? std::string("n/a") : fmt::format("{:.1f}", 100 * v));
    }
  }

  // Axis titles: the column title centred below the grid, the row title rotated left of the labels.
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#444444\">{}</text>\n", left + grid_w / 2,
                   top + std::max(grid_h, 60) + 26, xml_escape(m.col_title));
  const int mid_y = top + grid_h / 2;
  s += fmt::format("<text x=\"16\" y=\"{}\" text-anchor=\"middle\" fill=\"#444444\" transform=\"rotate(-90 16 {})\">"
                   "{}</text>\n",
                   mid_y, mid_y, xml_escape(m.row_title));

  // Colour bar: 100% at the top, 0% at the bottom.
  const int bar_h = std::max(grid_h, 60);
  s += "<defs><linearGradient id=\"heat\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">";
  for (int i = 0; i <= 4; ++i)
    s += fmt::format("<stop offset=\"{:.2f}\" stop-color=\"{}\"/>", i / 4.0, heatmap_colour(i / 4.0));
  s += "</linearGradient></defs>\n";
  s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"url(#heat)\" stroke=\"#888888\"/>\n",
                   bar_x, top, kBarW, bar_h);
  for (int i = 0; i <= 4; ++i)
    s += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"10\">{}%</text>\n", bar_x + kBarW + 4,
                     top + bar_h - i * bar_h / 4 + 4, 25 * i);
  s += "</svg>\n";
  return s;
}

}  // namespace hax
