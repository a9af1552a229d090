//! What `kubectl get` prints that the objects do not hold in a printable form: sizes in
//! binary units and the healthy/wanted replica count. The Kubernetes store writes them into
//! `status.display` at every status write ([`decorate`]); nothing in Zebu reads them back
//! (the Rust types do not even have the field, so a read drops it and the next status write
//! derives it again from the same object).

use serde_json::{Value, json};
use zebu_types::Kind;

/// `bytes` as a Kubernetes quantity in the largest binary unit that divides it exactly
/// (`10Gi`, `1536Mi`, `4097`), so kubectl shows a size a person reads at a glance and that
/// is still exact.
pub fn quantity(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["", "Ki", "Mi", "Gi", "Ti", "Pi"];
    if bytes == 0 {
        return "0".into();
    }
    let mut value = bytes;
    let mut power = 0;
    while power < UNITS.len() - 1 && value.is_multiple_of(1024) {
        value /= 1024;
        power += 1;
    }
    format!("{value}{}", UNITS[power])
}

/// Where each kind keeps the size its Size column shows.
fn size_pointer(kind: Kind) -> Option<&'static str> {
    match kind {
        Kind::Volume | Kind::Engine | Kind::Replica => Some("/spec/size"),
        Kind::Snapshot => Some("/status/size"),
        Kind::Backup => Some("/status/volumeSize"),
        Kind::Node | Kind::Setting | Kind::BackupTarget | Kind::RecurringJob => None,
    }
}

/// Set `status.display` of an object about to be written with `update_status`.
pub fn decorate(kind: Kind, object: &mut Value) {
    let Some(pointer) = size_pointer(kind) else {
        return;
    };
    let mut display = serde_json::Map::new();
    if let Some(bytes) = object.pointer(pointer).and_then(Value::as_u64) {
        display.insert("size".into(), json!(quantity(bytes)));
    }
    if kind == Kind::Volume {
        let wanted = object
            .pointer("/spec/numberOfReplicas")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let healthy = object
            .pointer("/status/replicas")
            .and_then(Value::as_array)
            .map_or(0, |rs| {
                rs.iter()
                    .filter(|r| r.get("mode").and_then(Value::as_str) == Some("RW"))
                    .count()
            });
        display.insert("replicas".into(), json!(format!("{healthy}/{wanted}")));
    }
    if !object.get("status").is_some_and(Value::is_object) {
        object["status"] = json!({});
    }
    object["status"]["display"] = Value::Object(display);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_exact_and_in_the_largest_unit() {
        assert_eq!(quantity(0), "0");
        assert_eq!(quantity(4097), "4097");
        assert_eq!(quantity(4096), "4Ki");
        assert_eq!(quantity(10 << 30), "10Gi");
        assert_eq!(quantity(1536 << 20), "1536Mi");
        assert_eq!(quantity(3 << 50), "3Pi");
        assert_eq!(quantity(2048 << 50), "2048Pi");
    }

    #[test]
    fn a_volume_shows_its_size_and_healthy_over_wanted_replicas() {
        let mut v = json!({
            "spec": {"size": 10u64 << 30, "numberOfReplicas": 3},
            "status": {"replicas": [
                {"name": "a", "node": "n1", "mode": "RW"},
                {"name": "b", "node": "n2", "mode": "WO"},
                {"name": "c", "node": "n3", "mode": "RW"},
            ]},
        });
        decorate(Kind::Volume, &mut v);
        assert_eq!(
            v["status"]["display"],
            json!({"size": "10Gi", "replicas": "2/3"})
        );
        let mut s = json!({"spec": {"value": "x"}, "status": {}});
        decorate(Kind::Setting, &mut s);
        assert_eq!(s["status"], json!({}));
    }
}
