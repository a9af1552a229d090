//! How the CLI prints: `-o json|yaml` the objects exactly as the API returns them, `-o table`
//! a summary with columns padded to their widest cell.

use std::io::Write;

use serde::Serialize;
use zebu_types::requests::SnapshotInfo;
use zebu_types::resources::{Node, Volume};
use zebu_types::size::ByteSize;

use super::args::Output;

/// Write to stdout and flush. A reader that went away (`zebu volume ls | head -1`) shows up
/// as an `io::Error` of kind `BrokenPipe`, which `main` treats as a quiet end (see
/// [`is_broken_pipe`]) instead of a panic, as `println!` would.
pub fn emit(text: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// Whether an error is stdout's reader having gone away.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// JSON or YAML (a table falls back to JSON for what has no table).
pub fn value(out: Output, v: &impl Serialize) -> anyhow::Result<()> {
    match out {
        Output::Json | Output::Table => emit(&format!("{}\n", serde_json::to_string_pretty(v)?)),
        Output::Yaml => emit(&serde_yaml::to_string(v)?),
    }
}

/// One object: its table row, or itself.
pub fn one<T: Serialize>(out: Output, item: &T, table: fn(&[T]) -> String) -> anyhow::Result<()> {
    match out {
        Output::Table => emit(&table(std::slice::from_ref(item))),
        _ => value(out, item),
    }
}

/// A list as `{"items": [...]}`, or its table.
pub fn list<T: Serialize>(
    out: Output,
    items: &zebu_types::requests::Items<T>,
    table: fn(&[T]) -> String,
) -> anyhow::Result<()> {
    match out {
        Output::Table => emit(&table(&items.items)),
        _ => value(out, items),
    }
}

/// Columns padded to their widest cell.
pub fn render(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut s = String::new();
    let line = |cells: Vec<&str>, s: &mut String| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        s.push_str(parts.join("  ").trim_end());
        s.push('\n');
    };
    line(header.to_vec(), &mut s);
    for r in &rows {
        line(r.iter().map(String::as_str).collect(), &mut s);
    }
    s
}

pub fn volume_table(items: &[Volume]) -> String {
    let rows = items
        .iter()
        .map(|v| {
            vec![
                v.metadata.name.clone(),
                v.spec.size.to_string(),
                v.spec.number_of_replicas.to_string(),
                if v.spec.disable_frontend {
                    "none".to_string()
                } else {
                    v.spec.frontend.to_string()
                },
                v.status.state.as_str().to_string(),
                v.status.robustness.as_str().to_string(),
                v.spec.node_id.clone().unwrap_or_else(|| "-".into()),
                v.status.endpoint.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    render(
        &[
            "NAME",
            "SIZE",
            "REPLICAS",
            "FRONTEND",
            "STATE",
            "ROBUSTNESS",
            "NODE",
            "ENDPOINT",
        ],
        rows,
    )
}

pub fn snapshot_table(items: &[SnapshotInfo]) -> String {
    let text = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            s.to_string()
        }
    };
    let rows = items
        .iter()
        .map(|s| {
            vec![
                text(&s.name),
                text(&s.parent),
                text(&s.created),
                ByteSize(s.data_bytes).approx(),
            ]
        })
        .collect();
    render(&["NAME", "PARENT", "CREATED", "DATA"], rows)
}

pub fn node_table(items: &[Node]) -> String {
    let rows = items
        .iter()
        .map(|n| {
            let (max, avail) = n.status.disk_status.values().fold((0, 0), |(m, a), d| {
                (
                    m + d.storage_maximum.bytes(),
                    a + d.storage_available.bytes(),
                )
            });
            vec![
                n.metadata.name.clone(),
                n.spec.address.clone(),
                if n.is_ready() { "True" } else { "False" }.into(),
                n.spec.disks.len().to_string(),
                ByteSize(avail).approx(),
                ByteSize(max).approx(),
            ]
        })
        .collect();
    render(
        &["NAME", "ADDRESS", "READY", "DISKS", "AVAILABLE", "MAXIMUM"],
        rows,
    )
}
