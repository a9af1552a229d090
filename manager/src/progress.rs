//! Rebuild progress for `zebu volume get NAME --watch`.
//!
//! The engine's `RebuildStatus` (bytes done of bytes total) flows into the
//! Engine's status (the node agent asks every half second), then into the
//! Volume's `status.rebuild` (the volume controller copies it while it is
//! `running`), then through the watch stream to here. [`RebuildView`] turns
//! the successive values into:
//!
//! - on a terminal, an `indicatif` bar with bytes, rate and ETA that is
//!   redrawn in place;
//! - otherwise (a pipe, a log file, a test), one plain line per update,
//!   `rebuild <replica> (<kind>): 42% 108 MiB/256 MiB, ETA 7s`, the ETA
//!   from the average rate since the first update this watch saw.
//!
//! When the volume no longer reports a rebuild the bar is finished, or a
//! `rebuild <replica> finished` line printed.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use zebu_types::resources::RebuildProgress;
use zebu_types::size::ByteSize;

struct Current {
    replica: String,
    /// When and at how many bytes this watch first saw the rebuild.
    first: (Instant, u64),
    bar: Option<ProgressBar>,
}

/// What a watch shows of rebuilds; see the module docs.
pub struct RebuildView {
    tty: bool,
    current: Option<Current>,
}

/// Seconds left at the average rate since `first`, if there is a rate yet.
pub fn eta(first: (Instant, u64), now: Instant, done: u64, total: u64) -> Option<Duration> {
    let elapsed = now.duration_since(first.0).as_secs_f64();
    let copied = done.saturating_sub(first.1) as f64;
    if elapsed < 0.2 || copied <= 0.0 {
        return None;
    }
    let rate = copied / elapsed;
    Some(Duration::from_secs_f64(
        total.saturating_sub(done) as f64 / rate,
    ))
}

/// The plain-text line for one update.
pub fn line(r: &RebuildProgress, eta: Option<Duration>) -> String {
    let pct = (r.bytes_done.min(r.bytes_total) * 100)
        .checked_div(r.bytes_total)
        .unwrap_or(0);
    let eta = eta.map_or_else(|| "?".to_string(), |d| format!("{}s", d.as_secs()));
    format!(
        "rebuild {} ({}): {pct}% {}/{}, ETA {eta}\n",
        r.replica,
        r.kind.as_str(),
        ByteSize(r.bytes_done).approx(),
        ByteSize(r.bytes_total).approx()
    )
}

impl RebuildView {
    pub fn new(tty: bool) -> Self {
        RebuildView { tty, current: None }
    }

    /// Show `rebuild` (the volume's `status.rebuild`); returns text to
    /// print on stdout when not drawing a bar.
    pub fn update(&mut self, rebuild: Option<&RebuildProgress>) -> String {
        let mut text = String::new();
        let same = |c: &Current| rebuild.is_some_and(|r| r.replica == c.replica);
        if let Some(c) = self.current.take_if(|c| !same(c)) {
            match c.bar {
                Some(bar) => bar.finish_with_message(format!("rebuild {} finished", c.replica)),
                None => text.push_str(&format!("rebuild {} finished\n", c.replica)),
            }
        }
        let Some(r) = rebuild else {
            return text;
        };
        let now = Instant::now();
        let tty = self.tty;
        let c = self.current.get_or_insert_with(|| Current {
            replica: r.replica.clone(),
            first: (now, r.bytes_done),
            bar: tty.then(|| {
                let bar = ProgressBar::with_draw_target(
                    Some(r.bytes_total),
                    ProgressDrawTarget::stdout(),
                );
                let style = ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
                bar.set_style(style);
                bar.set_message(format!("rebuild {} ({})", r.replica, r.kind.as_str()));
                bar
            }),
        });
        match &c.bar {
            Some(bar) => {
                bar.set_length(r.bytes_total);
                bar.set_position(r.bytes_done);
            }
            None => text.push_str(&line(r, eta(c.first, now, r.bytes_done, r.bytes_total))),
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(done: u64) -> RebuildProgress {
        RebuildProgress {
            replica: "v-r-1".into(),
            state: zebu_types::resources::RebuildState::Running,
            kind: zebu_types::resources::RebuildKind::Full,
            bytes_done: done,
            bytes_total: 256 << 20,
            error: String::new(),
        }
    }

    #[test]
    fn plain_lines_show_percent_bytes_and_an_eta_from_the_observed_rate() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(2);
        // 64 MiB in 2 s leaves 128 MiB: 4 s.
        let eta = eta((t0, 64 << 20), later, 128 << 20, 256 << 20);
        assert_eq!(eta, Some(Duration::from_secs(4)));
        assert_eq!(
            line(&progress(128 << 20), eta),
            "rebuild v-r-1 (full): 50% 128 MiB/256 MiB, ETA 4s\n"
        );
        assert_eq!(eta_none(), None);
        let mut view = RebuildView::new(false);
        assert!(
            view.update(Some(&progress(0)))
                .contains("0% 0 B/256 MiB, ETA ?")
        );
        assert_eq!(view.update(None), "rebuild v-r-1 finished\n");
        assert_eq!(view.update(None), "");
    }

    fn eta_none() -> Option<Duration> {
        let t0 = Instant::now();
        eta((t0, 5), t0 + Duration::from_secs(1), 5, 10)
    }
}
