//! `zebu`: the command line of Zebu; see [`zebu_manager::cli`].

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = match zebu_manager::cli::parse_args() {
        Ok(cli) => cli,
        Err(code) => return ExitCode::from(code),
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ZEBU_LOG")
                // kube's client logs every failed request as an error of its own; the
                // caller reports the same failure, with what it was doing, once.
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new("warn,kube_client::client::builder=off")
                }),
        )
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "zebu: cannot start the async runtime: {e}"
            );
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(zebu_manager::cli::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of our output went away (`| head`): nothing left to do.
        Err(e) if zebu_manager::cli::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "zebu: {e:#}");
            ExitCode::FAILURE
        }
    }
}
