package mirror

import (
	"bytes"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"time"

	"github.com/pelletier/go-toml/v2"
	tomlu "github.com/pelletier/go-toml/v2/unstable"

	"github.com/weightd/weightd/pkg/content"
)

// mirrorDialTimeout is the dial_timeout of the mirror's host entry: the
// agent is on the node, so a connection that is not up by then will not
// come, and a dead agent behind a blackholed address costs each request
// this much before containerd moves to the next host.
const mirrorDialTimeout = 200 * time.Millisecond

// hostsDoc is a hosts.toml as containerd 2.4 reads it
// (core/remotes/docker/config/hosts.go): the top-level keys, server and the
// settings that go with it, tried last; and the [host."URL"] tables, tried
// first, in the order their headers appear in the file.
type hostsDoc struct {
	top   map[string]any
	hosts []hostEntry
}

// hostEntry is one [host."URL"] table.
type hostEntry struct {
	url    string
	fields map[string]any
}

// parseHostsFile reads a hosts.toml found in dir, checking each value as
// containerd does (a file containerd would refuse is refused, with what is
// wrong), and makes relative ca and client paths absolute against dir, as
// containerd resolves them. Host tables that containerd ignores (given as
// dotted keys or inline tables, not as [host."URL"] headers) are dropped.
func parseHostsFile(b []byte, dir string) (hostsDoc, error) {
	var raw map[string]any
	if err := toml.Unmarshal(b, &raw); err != nil {
		return hostsDoc{}, fmt.Errorf("%w: %v", content.ErrInvalid, err)
	}
	order, err := hostTableOrder(b)
	if err != nil {
		return hostsDoc{}, fmt.Errorf("%w: %v", content.ErrInvalid, err)
	}
	doc := hostsDoc{top: map[string]any{}}
	var tables map[string]any
	for k, v := range raw {
		if k != "host" {
			doc.top[k] = v
			continue
		}
		var ok bool
		if tables, ok = v.(map[string]any); !ok {
			return hostsDoc{}, fmt.Errorf("%w: host is a %s, want tables", content.ErrInvalid, tomlType(v))
		}
	}
	for k, v := range doc.top {
		if strings.EqualFold(k, "server") {
			if err := checkServer(v); err != nil {
				return hostsDoc{}, err
			}
		}
	}
	if err := checkHostFields(doc.top, dir); err != nil {
		return hostsDoc{}, fmt.Errorf("server: %w", err)
	}
	// containerd decodes every host table, even those it then ignores.
	for u, v := range tables {
		fields, ok := v.(map[string]any)
		if !ok {
			return hostsDoc{}, fmt.Errorf("%w: host %q is a %s, want a table", content.ErrInvalid, u, tomlType(v))
		}
		if err := checkHostFields(fields, dir); err != nil {
			return hostsDoc{}, fmt.Errorf("host %q: %w", u, err)
		}
	}
	for _, u := range order {
		fields, ok := tables[u].(map[string]any)
		if !ok {
			return hostsDoc{}, fmt.Errorf("%w: host %q is a %s, want a table", content.ErrInvalid, u, tomlType(tables[u]))
		}
		if err := checkServer(u); err != nil {
			return hostsDoc{}, err
		}
		if pu, _ := url.Parse(withScheme(u)); pu.Host == "" {
			return hostsDoc{}, fmt.Errorf("%w: host %q names no host", content.ErrInvalid, u)
		}
		doc.hosts = append(doc.hosts, hostEntry{url: u, fields: fields})
	}
	return doc, nil
}

// hostTableOrder lists the hosts of the [host."URL"] headers (and their
// subtables) in the order they first appear, as containerd orders them.
func hostTableOrder(b []byte) ([]string, error) {
	var order []string
	seen := map[string]bool{}
	p := tomlu.Parser{}
	p.Reset(b)
	for p.NextExpression() {
		e := p.Expression()
		if e.Kind != tomlu.Table {
			continue
		}
		var parts []string
		for it := e.Key(); it.Next(); {
			parts = append(parts, string(it.Node().Data))
		}
		if len(parts) < 2 || parts[0] != "host" || seen[parts[1]] {
			continue
		}
		seen[parts[1]] = true
		order = append(order, parts[1])
	}
	return order, p.Error()
}

// checkServer checks a server or host URL as containerd parses it.
func checkServer(v any) error {
	s, ok := v.(string)
	if !ok {
		return fmt.Errorf("%w: server is a %s, want a string", content.ErrInvalid, tomlType(v))
	}
	if _, err := url.Parse(withScheme(s)); err != nil {
		return fmt.Errorf("%w: server %q: %v", content.ErrInvalid, s, err)
	}
	return nil
}

// withScheme adds https:// to a server without a scheme, as containerd does.
func withScheme(s string) string {
	if !strings.HasPrefix(s, "http") {
		return "https://" + s
	}
	return s
}

// checkHostFields checks the settings of a host (or of the server) as
// containerd does, and makes relative ca and client paths absolute
// against dir, in place. Keys containerd does not know are kept. Keys
// match whatever their case, as go-toml matches them to containerd's fields.
func checkHostFields(f map[string]any, dir string) error {
	for k, v := range f {
		var err error
		switch strings.ToLower(k) {
		case "capabilities":
			err = checkCapabilities(v)
		case "ca":
			f[k], err = absPaths(v, dir, false)
		case "client":
			f[k], err = absPaths(v, dir, true)
		case "skip_verify", "override_path":
			if _, ok := v.(bool); !ok {
				err = fmt.Errorf("is a %s, want a boolean", tomlType(v))
			}
		case "dial_timeout":
			s, ok := v.(string)
			if !ok {
				err = fmt.Errorf("is a %s, want a duration string", tomlType(v))
			} else if _, perr := time.ParseDuration(s); perr != nil {
				err = perr
			}
		case "header":
			err = checkHeader(v)
		}
		if err != nil {
			return fmt.Errorf("%w: %s: %v", content.ErrInvalid, k, err)
		}
	}
	return nil
}

func checkCapabilities(v any) error {
	list, ok := v.([]any)
	if !ok {
		return fmt.Errorf("is a %s, want a list", tomlType(v))
	}
	for _, c := range list {
		s, ok := c.(string)
		if !ok {
			return fmt.Errorf("holds a %s, want strings", tomlType(c))
		}
		switch strings.ToLower(s) {
		case "pull", "resolve", "push", "referrers":
		default:
			return fmt.Errorf("unknown capability %q", s)
		}
	}
	return nil
}

func checkHeader(v any) error {
	h, ok := v.(map[string]any)
	if !ok {
		return fmt.Errorf("is a %s, want a table", tomlType(v))
	}
	for name, val := range h {
		switch val := val.(type) {
		case string:
		case []any:
			for _, s := range val {
				if _, ok := s.(string); !ok {
					return fmt.Errorf("%s holds a %s, want strings", name, tomlType(s))
				}
			}
		default:
			return fmt.Errorf("%s is a %s, want a string or a list of strings", name, tomlType(val))
		}
	}
	return nil
}

// absPaths makes the paths of a ca (a path or a list of them) or a client
// (also a list of [cert, key] pairs) absolute against dir, as containerd's
// makeAbsPath does.
func absPaths(v any, dir string, pairs bool) (any, error) {
	abs := func(p string) string {
		if filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	switch v := v.(type) {
	case string:
		return abs(v), nil
	case []any:
		out := make([]any, len(v))
		for i, e := range v {
			switch e := e.(type) {
			case string:
				out[i] = abs(e)
			case []any:
				if !pairs || len(e) != 2 {
					return nil, fmt.Errorf("holds a list of %d, want paths or [cert, key] pairs", len(e))
				}
				pair := make([]any, 2)
				for j, p := range e {
					s, ok := p.(string)
					if !ok {
						return nil, fmt.Errorf("holds a pair with a %s, want paths", tomlType(p))
					}
					pair[j] = abs(s)
				}
				out[i] = pair
			default:
				return nil, fmt.Errorf("holds a %s, want paths", tomlType(e))
			}
		}
		return out, nil
	default:
		return nil, fmt.Errorf("is a %s, want a path or a list", tomlType(v))
	}
}

// withMirror puts the mirror first, pull and resolve only, dropping an
// entry for the same URL (ours, from an earlier configuration).
func (d hostsDoc) withMirror(mirrorURL string) hostsDoc {
	out := hostsDoc{top: d.top}
	out.hosts = append(out.hosts, hostEntry{url: mirrorURL, fields: map[string]any{
		"capabilities": []any{"pull", "resolve"},
		"dial_timeout": mirrorDialTimeout.String(),
	}})
	for _, h := range d.hosts {
		if strings.TrimSuffix(h.url, "/") != strings.TrimSuffix(mirrorURL, "/") {
			out.hosts = append(out.hosts, h)
		}
	}
	return out
}

// marshal writes the document with weightd's marker first and the host
// tables in order. go-toml sorts a map's keys, so each host table is
// encoded on its own.
func (d hostsDoc) marshal() ([]byte, error) {
	var b bytes.Buffer
	b.WriteString(hostsMarker + "\n")
	top, err := toml.Marshal(d.top)
	if err != nil {
		return nil, err
	}
	b.Write(top)
	for _, h := range d.hosts {
		t, err := toml.Marshal(map[string]any{"host": map[string]any{h.url: h.fields}})
		if err != nil {
			return nil, err
		}
		// The implicit parent table, declared once per host by go-toml,
		// would be a duplicate table from the second host on.
		t, ok := bytes.CutPrefix(t, []byte("[host]\n"))
		if !ok {
			return nil, fmt.Errorf("encoding host %q: unexpected %q", h.url, t)
		}
		b.WriteString("\n")
		b.Write(t)
	}
	return b.Bytes(), nil
}

// tomlType names a decoded TOML value's type for errors.
func tomlType(v any) string {
	switch v.(type) {
	case string:
		return "string"
	case bool:
		return "boolean"
	case int64, float64:
		return "number"
	case []any:
		return "list"
	case map[string]any:
		return "table"
	case nil:
		return "nothing"
	default:
		return "date or time"
	}
}
