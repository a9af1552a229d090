//! JSON schemas of the resource types, rewritten into the *structural* form Kubernetes
//! requires of a CRD (`openAPIV3Schema`).
//!
//! `schemars` (OpenAPI 3 settings, every subschema inlined) already gives `nullable`
//! instead of `null` types and `enum` instead of `const`. What a structural schema still
//! refuses, and what [`structural`] does about it:
//!
//! | schemars writes | Kubernetes wants | rewrite |
//! |---|---|---|
//! | `oneOf` of single-value string branches (an enum whose variants carry docs) | one `enum` | merged; each variant's doc joins the description as `` `value`: doc `` |
//! | `format: uint64`, `uint32`, `uint8`, `uint16`, `uint` | formats it knows | `int64` / `int32`; `minimum: 0` already says unsigned |
//! | `type: [T, "null"]` | one `type` | `type: T`, `nullable: true` |
//! | `additionalProperties: false` (on `deny_unknown_fields` types) | nothing (pruning drops unknown fields anyway) | removed |
//! | `default`, `examples`, `title`, `$schema` | (allowed, but a `default` is applied by the server and would change stored objects) | removed |
//!
//! Anything else that is not structural (a `$ref`, `anyOf`, `allOf`, a node without `type`)
//! is an error naming the path, so a new type the rewrite does not understand fails the CRD
//! test instead of producing a CRD the API server refuses.

use schemars::JsonSchema;
use schemars::generate::SchemaSettings;
use serde_json::{Map, Value, json};

/// Why a schema cannot become structural; names where in the schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("schema of {type_name} at {path}: {reason}")]
pub struct SchemaError {
    pub type_name: String,
    pub path: String,
    pub reason: String,
}

/// The structural schema of `T`, every subschema inlined.
pub fn structural_for<T: JsonSchema>() -> Result<Value, SchemaError> {
    let generator = SchemaSettings::openapi3()
        .with(|s| {
            s.inline_subschemas = true;
            s.meta_schema = None;
        })
        .into_generator();
    let root = generator.into_root_schema_for::<T>();
    let mut value = root.to_value();
    let type_name = T::schema_name().to_string();
    rewrite(&mut value, &type_name, "")?;
    Ok(value)
}

fn err(type_name: &str, path: &str, reason: impl Into<String>) -> SchemaError {
    SchemaError {
        type_name: type_name.to_string(),
        path: if path.is_empty() {
            ".".to_string()
        } else {
            path.to_string()
        },
        reason: reason.into(),
    }
}

/// The string values a `oneOf` branch allows (schemars groups the variants without docs
/// into one branch), and its doc.
fn string_values(branch: &Value) -> Option<(Vec<Value>, Option<String>)> {
    let values = branch.get("enum")?.as_array()?;
    let description = branch
        .get("description")
        .and_then(Value::as_str)
        .map(str::to_string);
    values
        .iter()
        .all(Value::is_string)
        .then(|| (values.clone(), description))
}

fn rewrite(node: &mut Value, type_name: &str, path: &str) -> Result<(), SchemaError> {
    let Some(obj) = node.as_object_mut() else {
        return Err(err(type_name, path, "a schema must be an object"));
    };
    for k in [
        "$schema",
        "title",
        "default",
        "examples",
        "example",
        "definitions",
    ] {
        obj.remove(k);
    }
    if let Some(Value::String(d)) = obj.get_mut("description") {
        *d = reflow(d);
    }
    if obj.get("additionalProperties") == Some(&Value::Bool(false)) {
        obj.remove("additionalProperties");
    }
    if let Some(branches) = obj.remove("anyOf") {
        unwrap_optional(obj, branches, type_name, path)?;
    }
    if let Some(branches) = obj.remove("oneOf") {
        merge_string_enum(obj, branches, type_name, path)?;
    }
    for forbidden in ["$ref", "anyOf", "allOf", "not", "const"] {
        if obj.contains_key(forbidden) {
            return Err(err(
                type_name,
                path,
                format!("{forbidden} has no structural form"),
            ));
        }
    }
    if let Some(Value::Array(types)) = obj.get("type").cloned() {
        let (nulls, others): (Vec<_>, Vec<_>) =
            types.into_iter().partition(|t| t.as_str() == Some("null"));
        match others.as_slice() {
            [one] => {
                obj.insert("type".into(), one.clone());
                if !nulls.is_empty() {
                    obj.insert("nullable".into(), Value::Bool(true));
                }
            }
            _ => return Err(err(type_name, path, "a schema needs exactly one type")),
        }
    }
    if obj.get("nullable") == Some(&Value::Bool(true))
        && let Some(Value::Array(values)) = obj.get_mut("enum")
    {
        values.retain(|v| !v.is_null());
    }
    if let Some(f) = obj.get("format").and_then(Value::as_str) {
        match f {
            "uint64" | "uint" | "int64" => {
                obj.insert("format".into(), json!("int64"));
            }
            "uint32" | "uint16" | "uint8" | "int32" | "int16" | "int8" => {
                obj.insert("format".into(), json!("int32"));
            }
            "double" | "float" | "date-time" | "date" | "byte" => {}
            _ => {
                obj.remove("format");
            }
        }
    }
    if !obj.contains_key("type") {
        return Err(err(type_name, path, "a structural schema needs a type"));
    }
    if let Some(Value::Object(props)) = obj.get_mut("properties") {
        for (name, sub) in props.iter_mut() {
            rewrite(sub, type_name, &format!("{path}.{name}"))?;
        }
    }
    for k in ["additionalProperties", "items"] {
        if let Some(sub) = obj.get_mut(k)
            && sub.is_object()
        {
            rewrite(sub, type_name, &format!("{path}[{k}]"))?;
        }
    }
    Ok(())
}

/// A doc comment's lines joined into paragraphs: kubectl wraps descriptions itself, and
/// the source's line breaks would show as ragged lines.
fn reflow(doc: &str) -> String {
    doc.split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n\n")
}

fn is_null_branch(b: &Value) -> bool {
    b.get("type").and_then(Value::as_str) == Some("null")
        || b.get("enum")
            .and_then(Value::as_array)
            .is_some_and(|e| e.iter().all(Value::is_null))
}

/// `anyOf: [X, null]` (an `Option` of a type that is not a plain `$ref`) → `X` with
/// `nullable: true`; the outer description (the field's doc) wins over the type's.
fn unwrap_optional(
    obj: &mut Map<String, Value>,
    branches: Value,
    type_name: &str,
    path: &str,
) -> Result<(), SchemaError> {
    let branches = branches.as_array().cloned().unwrap_or_default();
    let (nulls, others): (Vec<_>, Vec<_>) = branches.into_iter().partition(is_null_branch);
    let [inner] = others.as_slice() else {
        return Err(err(
            type_name,
            path,
            "anyOf is only understood as an optional value",
        ));
    };
    let Some(inner) = inner.as_object() else {
        return Err(err(type_name, path, "an anyOf branch must be an object"));
    };
    for (k, v) in inner {
        if k != "description" || !obj.contains_key("description") {
            obj.insert(k.clone(), v.clone());
        }
    }
    if !nulls.is_empty() {
        obj.insert("nullable".into(), Value::Bool(true));
    }
    Ok(())
}

/// `oneOf: [{enum: [a, b]}, {enum: [c], description: d}]` → `enum: [a, b, c]`, with `` `c`: d ``
/// appended to the description so `kubectl explain` still tells what each value means.
fn merge_string_enum(
    obj: &mut Map<String, Value>,
    branches: Value,
    type_name: &str,
    path: &str,
) -> Result<(), SchemaError> {
    let branches = branches.as_array().cloned().unwrap_or_default();
    let mut values = Vec::new();
    let mut docs = Vec::new();
    for b in &branches {
        let (vs, doc) = string_values(b).ok_or_else(|| {
            err(
                type_name,
                path,
                "oneOf is only understood for enums of plain strings",
            )
        })?;
        if let Some(d) = doc {
            let names: Vec<String> = vs
                .iter()
                .filter_map(Value::as_str)
                .map(|s| format!("`{s}`"))
                .collect();
            let end = if d.ends_with('.') { "" } else { "." };
            docs.push(format!("{}: {d}{end}", names.join(", ")));
        }
        values.extend(vs);
    }
    obj.insert("type".into(), json!("string"));
    obj.insert("enum".into(), Value::Array(values));
    if !docs.is_empty() {
        let mut d = obj
            .get("description")
            .and_then(Value::as_str)
            .map(|s| format!("{s} "))
            .unwrap_or_default();
        d.push_str(&docs.join(" "));
        obj.insert("description".into(), Value::String(d));
    }
    Ok(())
}

/// `value` with every object's keys in sorted order, whatever order serde_json keeps
/// (`preserve_order` may be switched on by another crate in the build), so the generated
/// YAML is the same byte for byte in every build.
pub fn sorted(value: &Value) -> Value {
    match value {
        Value::Object(m) => {
            let mut keys: Vec<_> = m.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for k in keys {
                out.insert(k.clone(), sorted(&m[k]));
            }
            Value::Object(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
        other => other.clone(),
    }
}
