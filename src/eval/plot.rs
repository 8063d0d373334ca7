//! `eval-ppl --plot FILE.svg`: mean KL divergence from the reference against the position in
//! the window, one line per compared model (docs/eval.md, Position ranges), drawn with plotters'
//! SVG backend. The same scores give the same bytes.

use super::score::{kl_bins, PositionSums};
use anyhow::{anyhow, Result};
use plotters::prelude::*;

/// Bins along the window: enough to show a trend at 32K positions without a line of noise.
const BINS: usize = 128;

/// The SVG text of the plot: `models` are (label, per-position sums against the reference).
pub fn kl_by_position_svg(models: &[(String, &PositionSums)], seqlen: usize) -> Result<String> {
    let series: Vec<(String, Vec<(f64, f64)>)> = models
        .iter()
        .map(|(name, s)| {
            let pts = kl_bins(s, BINS)
                .into_iter()
                .map(|(p, kl)| (p as f64, kl))
                .collect();
            (name.clone(), pts)
        })
        .collect();
    let ymax = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|&(_, y)| y))
        .fold(0f64, f64::max)
        .max(1e-6)
        * 1.1;
    let xmax = seqlen.max(2) as f64;
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing the KL plot: {e}");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 540)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Mean KL divergence from the reference, by position in the window",
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(72)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("position of the predicting token (tokens)")
            .y_desc("mean KL (nats)")
            .draw()
            .map_err(|e| err(&e))?;
        for (i, (name, pts)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plot_is_an_svg_with_a_line_per_model_and_the_same_bytes_each_time() {
        let s = PositionSums {
            nll: vec![1.0; 300],
            kl: (0..300).map(|p| p as f64 * 1e-3).collect(),
            agree: vec![1; 300],
            count: vec![1; 300],
        };
        let models = vec![("a".to_string(), &s), ("b".to_string(), &s)];
        let svg = kl_by_position_svg(&models, 301).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(
            svg.contains(">\na\n</text>") || svg.contains(">a</text>"),
            "{}",
            &svg[..400]
        );
        assert_eq!(
            svg.matches(r#"stroke-width="2""#).count(),
            2,
            "one line per model"
        );
        assert_eq!(svg, kl_by_position_svg(&models, 301).unwrap());
    }
}
