//! The `[openai] api_keys` file: one `KEY TENANT` per line, `#` to the end of a line is a
//! comment. A request must carry `Authorization: Bearer KEY` for one of the keys, and is
//! charged to its tenant.

use std::collections::HashMap;
use std::path::Path;

/// Keys by their text, each with its tenant.
#[derive(Clone, Default)]
pub struct Keys(HashMap<String, String>);

/// The keys are secrets: never printed.
impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keys({} keys)", self.0.len())
    }
}

impl Keys {
    /// Reads the file at `path`.
    pub fn load(path: &Path) -> Result<Keys, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading [openai] api_keys {}: {e}", path.display()))?;
        Keys::parse(&text).map_err(|e| format!("[openai] api_keys {}: {e}", path.display()))
    }

    /// Parses the text of a key file; an error names the line (never the key).
    pub fn parse(text: &str) -> Result<Keys, String> {
        let mut keys = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            let [key, tenant] = words[..] else {
                return Err(format!("line {}: expected \"KEY TENANT\"", i + 1));
            };
            if key.len() < 16 {
                return Err(format!(
                    "line {}: the key is {} characters; use at least 16",
                    i + 1,
                    key.len()
                ));
            }
            if !libkv::proto::is_valid_tenant(tenant) {
                return Err(format!(
                    "line {}: tenant {tenant:?} is not 1 to {} bytes of [A-Za-z0-9_.-]",
                    i + 1,
                    libkv::proto::MAX_TENANT_BYTES
                ));
            }
            if keys.insert(key.to_owned(), tenant.to_owned()).is_some() {
                return Err(format!("line {}: the key repeats an earlier line's", i + 1));
            }
        }
        if keys.is_empty() {
            return Err("no keys: every request would be refused".into());
        }
        Ok(Keys(keys))
    }

    /// The tenant of the key `key`.
    pub fn tenant(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_names_its_tenant() {
        let k =
            Keys::parse("# keys\nsk-aaaaaaaaaaaaaaaa acme\n\nsk-bbbbbbbbbbbbbbbb globex # ops\n")
                .unwrap();
        assert_eq!(k.tenant("sk-aaaaaaaaaaaaaaaa"), Some("acme"));
        assert_eq!(k.tenant("sk-bbbbbbbbbbbbbbbb"), Some("globex"));
        assert_eq!(k.tenant("sk-cccccccccccccccc"), None);
        assert!(!format!("{k:?}").contains("sk-"), "keys are never printed");
    }

    #[test]
    fn bad_files_are_refused_by_line_without_the_key() {
        let e = Keys::parse("sk-aaaaaaaaaaaaaaaa\n").unwrap_err();
        assert!(e.contains("line 1"), "{e}");
        let e = Keys::parse("short acme\n").unwrap_err();
        assert!(e.contains("at least 16") && !e.contains("short"), "{e}");
        let e = Keys::parse("sk-aaaaaaaaaaaaaaaa bad/tenant\n").unwrap_err();
        assert!(e.contains("tenant"), "{e}");
        let e = Keys::parse("sk-aaaaaaaaaaaaaaaa a\nsk-aaaaaaaaaaaaaaaa b\n").unwrap_err();
        assert!(e.contains("line 2") && !e.contains("sk-"), "{e}");
        assert!(Keys::parse("# none\n").is_err());
    }
}
