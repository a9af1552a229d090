//! Write the CRDs of every Zebu kind, generated from the Rust types, into a directory
//! (`deploy/crds` in the repository): `zebu-crds DIR`. With `--check`, write nothing and
//! fail if any file differs from what the types generate.

use std::path::PathBuf;
use std::process::ExitCode;

use zebu_kube_store::crd;
use zebu_types::Kind;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut check = false;
    let mut dir = None;
    for a in args.by_ref() {
        match a.as_str() {
            "--check" => check = true,
            "-h" | "--help" => {
                println!("usage: zebu-crds [--check] DIR");
                return ExitCode::SUCCESS;
            }
            _ => dir = Some(PathBuf::from(a)),
        }
    }
    let Some(dir) = dir else {
        eprintln!("usage: zebu-crds [--check] DIR");
        return ExitCode::from(2);
    };
    let mut stale = Vec::new();
    for kind in Kind::ALL {
        let text = match crd::yaml(kind) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("zebu-crds: {e}");
                return ExitCode::FAILURE;
            }
        };
        let path = dir.join(crd::file_name(kind));
        let current = std::fs::read_to_string(&path).ok();
        if current.as_deref() == Some(text.as_str()) {
            continue;
        }
        if check {
            stale.push(path.display().to_string());
            continue;
        }
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text)) {
            eprintln!("zebu-crds: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {}", path.display());
    }
    if !stale.is_empty() {
        eprintln!(
            "zebu-crds: out of date: {}\nregenerate with `{}`",
            stale.join(", "),
            crd::REGENERATE
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
