//! Benchmarks live in `src/bin/`; see `benches/README.md`.
fn main() {
    eprintln!("run one of the benchmark binaries; see benches/README.md");
}
