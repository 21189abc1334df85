package loratest_test

import (
	"encoding/json"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/lora"
)

type reply struct {
	status int
	ctype  string
	body   string
}

func post(t *testing.T, url, body string) reply {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{resp.StatusCode, resp.Header.Get("Content-Type"), string(b)}
}

func get(t *testing.T, url string) reply {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{resp.StatusCode, resp.Header.Get("Content-Type"), string(b)}
}

func jsonMap(t *testing.T, s string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return m
}

func fixture(t *testing.T, s loratest.AdapterSpec) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "a")
	if err := loratest.WriteAdapter(dir, s); err != nil {
		t.Fatal(err)
	}
	if _, err := lora.Inspect(dir); err != nil {
		t.Fatalf("WriteAdapter wrote an adapter Inspect refuses: %v", err)
	}
	return dir
}

// The vLLM server answers as vLLM does: plain-text success, JSON errors in
// the chosen shape, /v1/models with parent and root.
func TestVLLMWire(t *testing.T) {
	t.Parallel()
	for _, nested := range []bool{false, true} {
		srv, err := loratest.NewVLLM(loratest.Options{Base: "org/base", NestedErrors: nested})
		if err != nil {
			t.Fatal(err)
		}
		defer srv.Close()
		path := fixture(t, loratest.AdapterSpec{})
		load := `{"lora_name":"a","lora_path":"` + path + `"}`

		r := post(t, srv.URL()+"/v1/load_lora_adapter", load)
		if r.status != 200 || !strings.HasPrefix(r.ctype, "text/plain") || r.body != "Success: LoRA adapter 'a' added successfully." {
			t.Fatalf("load: %+v", r)
		}
		r = post(t, srv.URL()+"/v1/load_lora_adapter", load)
		m := jsonMap(t, r.body)
		if nested {
			m = m["error"].(map[string]any)
		} else if m["object"] != "error" {
			t.Fatalf("flat error %v", m)
		}
		if r.status != 400 || m["message"] != "The lora adapter 'a' has already been loaded." || m["code"] != float64(400) {
			t.Fatalf("second load: %d %v", r.status, m)
		}

		r = get(t, srv.URL()+"/v1/models")
		data := jsonMap(t, r.body)["data"].([]any)
		base, ad := data[0].(map[string]any), data[1].(map[string]any)
		if len(data) != 2 || base["id"] != "org/base" || base["parent"] != nil || ad["id"] != "a" || ad["parent"] != "org/base" || ad["root"] != path {
			t.Fatalf("models %v", data)
		}

		r = post(t, srv.URL()+"/v1/unload_lora_adapter", `{"lora_name":"b"}`)
		if r.status != 404 || !strings.Contains(r.body, "NotFoundError") {
			t.Fatalf("unload of an unknown adapter: %+v", r)
		}
		if r := get(t, srv.URL()+"/v1/nothing"); r.status != 404 || r.body != "{\"detail\":\"Not Found\"}\n" {
			t.Fatalf("unknown route: %+v", r)
		}
	}
}

func TestSGLangWire(t *testing.T) {
	t.Parallel()
	srv, err := loratest.NewSGLang(loratest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	path := fixture(t, loratest.AdapterSpec{})
	r := post(t, srv.URL()+"/load_lora_adapter", `{"lora_name":"a","lora_path":"`+path+`","pinned":true}`)
	m := jsonMap(t, r.body)
	ref, _ := m["loaded_adapters"].(map[string]any)["a"].(map[string]any)
	if r.status != 200 || m["success"] != true || ref["lora_path"] != path || ref["pinned"] != true {
		t.Fatalf("load: %+v", r)
	}
	r = post(t, srv.URL()+"/unload_lora_adapter", `{"lora_name":"b"}`)
	m = jsonMap(t, r.body)
	if r.status != 400 || m["success"] != false || !strings.Contains(m["error_message"].(string), "does not exist") {
		t.Fatalf("unload of an unknown adapter: %+v", r)
	}
	// The old route prefix of vLLM is not SGLang's.
	if r := post(t, srv.URL()+"/v1/load_lora_adapter", `{}`); r.status != 404 {
		t.Fatalf("vLLM route on SGLang: %+v", r)
	}
}

// Restart drops every adapter, keeps the address and the counters.
func TestRestart(t *testing.T) {
	t.Parallel()
	srv, err := loratest.NewSGLang(loratest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	url := srv.URL()
	path := fixture(t, loratest.AdapterSpec{})
	if r := post(t, url+"/load_lora_adapter", `{"lora_name":"a","lora_path":"`+path+`"}`); r.status != 200 {
		t.Fatalf("load: %+v", r)
	}
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	if srv.URL() != url || len(srv.Loaded()) != 0 || srv.Loads("a") != 1 {
		t.Fatalf("after restart: %s %v %d", srv.URL(), srv.Loaded(), srv.Loads("a"))
	}
	if r := get(t, url+"/health"); r.status != 200 {
		t.Fatalf("health: %+v", r)
	}
	srv.Kill()
	if _, err := http.Get(url + "/health"); err == nil {
		t.Fatal("a killed server answers")
	}
}
