//! Benchmark tables as charts: grouped bar charts written as SVG (plotters), so the README
//! can show what a benchmark measured next to its table. A chart is drawn from the numbers
//! a run measured, never from constants.

use plotters::prelude::*;
use std::path::Path;

/// One group of bars (a batch size, a worker count, ...): its label and each series' value.
#[derive(Clone, Debug)]
pub struct Group {
    pub label: String,
    pub values: Vec<f64>,
}

/// A grouped bar chart: `series` names the bars of every group, in order; `reference` draws
/// a dashed horizontal line (a target, or 1.0 for a ratio), if given.
#[derive(Clone, Debug)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    pub series: Vec<String>,
    pub groups: Vec<Group>,
    pub reference: Option<(f64, String)>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

impl BarChart {
    /// Writes the chart to `path` as SVG.
    pub fn write_svg(&self, path: &Path) -> Result<(), String> {
        let series = self.series.len().max(1);
        let top = self
            .groups
            .iter()
            .flat_map(|g| g.values.iter().copied())
            .chain(self.reference.as_ref().map(|r| r.0))
            .fold(0.0f64, f64::max)
            * 1.15;
        let top = if top > 0.0 { top } else { 1.0 };
        let n = self.groups.len();
        let root = SVGBackend::new(path, (860, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..n as f64, 0.0..top)
            .map_err(|e| e.to_string())?;
        let labels: Vec<String> = self.groups.iter().map(|g| g.label.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n.max(1) * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor();
                if (x - i - 0.5).abs() < 1e-6 && i >= 0.0 {
                    // A non-negative whole number below the group count (checked above).
                    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                    let i = i as usize;
                    labels.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc(&self.y_label)
            .draw()
            .map_err(|e| e.to_string())?;
        let width = 0.8 / series as f64;
        for (s, name) in self.series.iter().enumerate() {
            let color = COLORS[s % COLORS.len()];
            let bars = self.groups.iter().enumerate().filter_map(|(g, group)| {
                let v = *group.values.get(s)?;
                let x0 = g as f64 + 0.1 + width * s as f64;
                Some(Rectangle::new(
                    [(x0, 0.0), (x0 + width * 0.92, v)],
                    color.filled(),
                ))
            });
            chart
                .draw_series(bars)
                .map_err(|e| e.to_string())?
                .label(name)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        if let Some((y, name)) = &self.reference {
            let y = *y;
            chart
                .draw_series(DashedLineSeries::new(
                    [(0.0, y), (n as f64, y)],
                    6,
                    4,
                    BLACK.stroke_width(1),
                ))
                .map_err(|e| e.to_string())?
                .label(name)
                .legend(move |(x, yy)| PathElement::new([(x, yy), (x + 12, yy)], BLACK));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_holds_a_bar_per_value_and_every_label() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.svg");
        BarChart {
            title: "pull / memcpy".into(),
            y_label: "ratio".into(),
            series: vec!["1 thread".into(), "2 threads".into()],
            groups: vec![
                Group {
                    label: "64 KiB".into(),
                    values: vec![0.5, 0.7],
                },
                Group {
                    label: "1 MiB".into(),
                    values: vec![0.9],
                },
            ],
            reference: Some((0.9, "target".into())),
        }
        .write_svg(&path)
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{svg}");
        for text in [
            "pull / memcpy",
            "64 KiB",
            "1 MiB",
            "1 thread",
            "2 threads",
            "target",
        ] {
            assert!(svg.contains(text), "no {text} in the chart");
        }
        // Three bars plus the two legend swatches, the background and the legend box.
        let filled = svg.matches("<rect").count();
        assert!(filled >= 3 + 2, "{filled} rects");
    }
}
