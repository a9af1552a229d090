//! Parsing of the sizes and durations people type on command lines.

/// Parses a size like [`parse_bytes`] and refuses zero.
pub fn parse_size(s: &str) -> Result<u64, String> {
    zebu_size::parse_nonzero(s).map_err(|e| e.to_string())
}

/// Parses `0`, `4096`, `512M`, `10G`, `1T`, `2GiB` (binary units, any case): `zebu-size`, the
/// one size parser of every Zebu program.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    zebu_size::parse(s).map_err(|e| e.to_string())
}

/// Parses `5s`, `500ms`, `2m`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration '{s}': expected a number like 5s or 500ms"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        other => {
            return Err(format!(
                "invalid duration '{s}': unknown unit '{other}' (use ms, s, m or h)"
            ));
        }
    };
    if !(secs > 0.0 && secs < 86_400.0 * 365.0) {
        return Err(format!("invalid duration '{s}': must be positive"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1t"), Ok(1 << 40));
        assert!(
            parse_size("10Q")
                .unwrap_err()
                .contains("unknown unit \"Q\"")
        );
        assert!(parse_size("G").is_err());
        assert!(parse_size("0").is_err());
        assert_eq!(parse_bytes("0"), Ok(0));
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s"), Ok(std::time::Duration::from_secs(5)));
        assert_eq!(
            parse_duration("500ms"),
            Ok(std::time::Duration::from_millis(500))
        );
        assert!(parse_duration("-1s").is_err());
        assert_eq!(
            parse_duration("2h"),
            Ok(std::time::Duration::from_secs(7200))
        );
        assert!(parse_duration("5d").is_err());
    }
}
