// TLS and mutual TLS on the coordinator's gRPC port (docs/SERVICE.md "TLS"). The certificates
// are throwaway ones made with the openssl CLI in a temp dir when the suite starts; without
// openssl the tests skip.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/agent.h"
#include "coordinator/client.h"
#include "coordinator/server.h"
#include "proto/infersweep.grpc.pb.h"
#include "proto/rpc.h"
#include "storage/store.h"
#include "tests/raw_agent.h"
#include "tests/test_util.h"

namespace infersweep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// One CPU trial, run on an agent that advertises a fake sm_120 label.
constexpr char kSweep[] = R"(name: tls-smoke
model: preset:tiny-moe
layers: 1
matrix:
  device: [cpu]
  matmul: [naive]
workload: {prompt: 8, output: 4, batch: [1], repeats: 1, warmup: 0}
selector: {sm: [120]}
)";
constexpr char kFakeGpu[] = "NVIDIA RTX PRO 6000:sm_120:96";



// The throwaway PKI: ca (signs server + client), other-ca (signs nothing we serve).
struct Pki {
  std::string dir;
  std::string ca, server_cert, server_key, client_cert, client_key, other_ca;
  // Client certificates from the same CA: CN=attacker, and a second CN=test-agent with its own
  // key (another credential naming the same agent id).
  std::string attacker_cert, attacker_key, twin_cert, twin_key;
  std::string error;  // why it could not be made; empty when it was
};

Pki* g_pki = nullptr;

Pki MakePki() {
  Pki pki;
  std::string tmpl = (std::filesystem::temp_directory_path() / "tls-pki-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    pki.error = "mkdtemp failed";
    return pki;
  }
  pki.dir = tmpl;
  const std::string d = pki.dir;
  { std::ofstream(d + "/server.ext") << "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                        "basicConstraints=CA:FALSE\n"
                                        "extendedKeyUsage=serverAuth\n"; }
  { std::ofstream(d + "/client.ext") << "basicConstraints=CA:FALSE\n"
                                        "extendedKeyUsage=clientAuth\n"; }
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string script = absl::StrCat(
      "set -e; cd '", d, "'; ", "openssl req -x509 ", ec,
      " -keyout ca.key -out ca.pem -days 2 -subj '/CN=infersweep test CA'; ", "openssl req -x509 ",
      ec, " -keyout other-ca.key -out other-ca.pem -days 2 -subj '/CN=some other CA'; ",
      "openssl req ", ec, " -keyout server.key -out server.csr -subj '/CN=localhost'; ",
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 ",
      "-extfile server.ext -out server.pem; ",
      "for c in client:test-agent attacker:attacker twin:test-agent; do ",
      "  f=${c%%:*}; cn=${c#*:}; ", "  openssl req ", ec,
      " -keyout $f.key -out $f.csr -subj \"/CN=$cn\"; ",
      "  openssl x509 -req -in $f.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 ",
      "  -extfile client.ext -out $f.pem; ", "done; ",
      "chmod 600 *.key; ");  // private keys others can read are refused (CheckSecretFileMode)
  int rc = 0;
  const std::string out = RunCommand(absl::StrCat("(", script, ") 2>&1"), &rc);
  if (rc != 0) {
    pki.error = absl::StrCat("openssl failed (", rc, "): ", out);
    return pki;
  }
  pki.ca = d + "/ca.pem";
  pki.other_ca = d + "/other-ca.pem";
  pki.server_cert = d + "/server.pem";
  pki.server_key = d + "/server.key";
  pki.client_cert = d + "/client.pem";
  pki.client_key = d + "/client.key";
  pki.attacker_cert = d + "/attacker.pem";
  pki.attacker_key = d + "/attacker.key";
  pki.twin_cert = d + "/twin.pem";
  pki.twin_key = d + "/twin.key";
  return pki;
}

class Tls : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (g_pki != nullptr) return;
    g_pki = new Pki;
    int rc = 0;
    RunCommand("command -v openssl >/dev/null 2>&1", &rc);
    if (rc != 0) {
      g_pki->error = "openssl CLI not found (scripts/deps.sh installs it)";
      return;
    }
    *g_pki = MakePki();
  }
  static void TearDownTestSuite() {
    if (g_pki != nullptr && !g_pki->dir.empty()) std::filesystem::remove_all(g_pki->dir);
    delete g_pki;
    g_pki = nullptr;
  }

  void SetUp() override {
    if (g_pki->error.rfind("openssl CLI not found", 0) == 0) GTEST_SKIP() << g_pki->error;
    ASSERT_TRUE(g_pki->error.empty()) << g_pki->error;
    std::string tmpl = (std::filesystem::temp_directory_path() / "tls-test-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    agents_.clear();
    if (server_) server_->Stop();
    server_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  const Pki& pki() { return *g_pki; }

  void StartCoordinator(bool mutual, const std::string& agent_token = "") {
    CoordinatorOptions o;
    o.agent_token = agent_token;
    o.tick_ms = 50;
    o.lease_ms = 20'000;
    o.tls.cert_file = pki().server_cert;
    o.tls.key_file = pki().server_key;
    if (mutual) o.tls.client_ca_file = pki().ca;
    o.log = [this](const std::string& line) { Remember("coordinator", line); };
    server_ = std::make_unique<CoordinatorServer>(o);
    auto port = server_->Start("127.0.0.1:0", dir_ + "/c.db");
    ASSERT_TRUE(port.ok()) << port.status();
    port_ = *port;
    address_ = absl::StrCat("127.0.0.1:", port_);
  }

  // Client-side options trusting `ca`, with the client certificate when `with_cert`.
  rpc::TlsOptions ClientTls(const std::string& ca, bool with_cert) {
    rpc::TlsOptions t;
    t.ca_file = ca;
    if (with_cert) {
      t.cert_file = pki().client_cert;
      t.key_file = pki().client_key;
    }
    return t;
  }

  Agent* StartAgent(const std::string& id, const rpc::TlsOptions& tls) {
    AgentOptions o;
    o.coordinator = address_;
    o.agent_id = id;
    o.spool_path = absl::StrCat(dir_, "/", id, ".spool.db");
    o.test_fake_gpus = {kFakeGpu};
    o.worker_argv = {INFERSWEEP_BINARY, "worker"};
    o.initial_backoff_ms = 50;
    o.max_backoff_ms = 300;
    o.tls = tls;
    o.log = [this, id](const std::string& line) { Remember(id, line); };
    auto agent = std::make_unique<Agent>(o);
    absl::Status s = agent->Start();
    EXPECT_TRUE(s.ok()) << s;
    agents_.push_back(std::move(agent));
    return agents_.back().get();
  }

  void Remember(const std::string& who, const std::string& line) { log_.Add(who, line); }
  std::string Log() { return log_.Text(); }

  std::string dir_, address_;
  int port_ = 0;
  std::unique_ptr<CoordinatorServer> server_;
  std::vector<std::unique_ptr<Agent>> agents_;
  LineLog log_;
};

TEST_F(Tls, ClientTrustingTheCaSubmitsAndPlaintextOrWrongCaFail) {
  StartCoordinator(/*mutual=*/false);
  EXPECT_THAT(Log(), HasSubstr("(port " + std::to_string(port_) + ", TLS)"));

  // The right CA: by IP (the certificate's IP SAN), and by name through the override.
  ServiceClient good(address_, 10'000, "", ClientTls(pki().ca, false));
  ASSERT_TRUE(good.tls_status().ok()) << good.tls_status();
  auto submitted = good.SubmitSweep(kSweep, "tls.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  EXPECT_EQ(submitted->trial_count(), 1);
  rpc::TlsOptions by_name = ClientTls(pki().ca, false);
  by_name.server_name_override = "localhost";
  ServiceClient named(address_, 10'000, "", by_name);
  EXPECT_TRUE(named.GetSweep(submitted->sweep_id()).ok());

  // Plaintext against the TLS port: no handshake, UNAVAILABLE, nothing stored.
  ServiceClient plain(address_, 5'000);
  auto p = plain.SubmitSweep(kSweep, "tls.yaml");
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable) << p.status();

  // A client that trusts another CA refuses the coordinator's certificate.
  ServiceClient wrong_ca(address_, 5'000, "", ClientTls(pki().other_ca, false));
  auto w = wrong_ca.SubmitSweep(kSweep, "tls.yaml");
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kUnavailable) << w.status();

  // A name the certificate does not carry fails verification too.
  rpc::TlsOptions wrong_name = ClientTls(pki().ca, false);
  wrong_name.server_name_override = "coordinator.example.com";
  ServiceClient misnamed(address_, 5'000, "", wrong_name);
  EXPECT_EQ(misnamed.ListSweeps().status().code(), absl::StatusCode::kUnavailable);

  auto sweeps = good.ListSweeps();
  ASSERT_TRUE(sweeps.ok()) << sweeps.status();
  EXPECT_EQ(sweeps->sweeps_size(), 1) << "a refused client stored a sweep";
}

TEST_F(Tls, MutualTlsRefusesAgentsWithoutAClientCertificate) {
  StartCoordinator(/*mutual=*/true);
  EXPECT_THAT(Log(), HasSubstr("mutual TLS"));

  // TLS with the right CA but no client certificate: the handshake fails, every time.
  Agent* anonymous = StartAgent("anonymous", ClientTls(pki().ca, false));
  EXPECT_FALSE(WaitFor([&] { return anonymous->connected(); }, 2)) << Log();
  EXPECT_EQ(server_->stats().agents_connected, 0);
  EXPECT_EQ(anonymous->stats().connects, 0);
  // A plaintext agent neither.
  Agent* plain = StartAgent("plain", rpc::TlsOptions{});
  EXPECT_FALSE(WaitFor([&] { return plain->connected(); }, 1)) << Log();
  EXPECT_EQ(plain->stats().connects, 0);
  // Nor a user-API client without a certificate.
  ServiceClient no_cert(address_, 5'000, "", ClientTls(pki().ca, false));
  EXPECT_EQ(no_cert.ListAgents().status().code(), absl::StatusCode::kUnavailable);

  // With the client certificate, as the agent id it names: connected, and it runs a sweep to
  // the end.
  Agent* agent = StartAgent("test-agent", ClientTls(pki().ca, true));
  ASSERT_TRUE(WaitFor([&] { return agent->connected(); }, 10)) << Log();
  ServiceClient client(address_, 10'000, "", ClientTls(pki().ca, true));
  auto agents = client.ListAgents();
  ASSERT_TRUE(agents.ok()) << agents.status();
  ASSERT_EQ(agents->agents_size(), 1) << "a refused agent was recorded";
  EXPECT_EQ(agents->agents(0).agent_id(), "test-agent");

  auto submitted = client.SubmitSweep(kSweep, "tls.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  v1::SweepInfo info;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto s = client.GetSweep(submitted->sweep_id());
        if (!s.ok()) return false;
        info = *s;
        return s->state() != "active";
      },
      45))
      << Log();
  EXPECT_EQ(info.state(), "done");
  EXPECT_EQ(info.status_counts().at("OK"), 1) << Log();
  EXPECT_EQ(agent->stats().assignments, 1);
  EXPECT_EQ(anonymous->stats().connects, 0);
  EXPECT_EQ(plain->stats().connects, 0);
}

// The attack on a fleet with mutual TLS and a shared agent token: a holder of the token and of
// another certificate from the CA opens a stream as a connected agent, claims its leased trial
// and reports a forged result. Its stream is refused, the victim's stream and lease stay, and
// only the victim's result is stored.
TEST_F(Tls, ACertificateThatDoesNotNameTheAgentIdCannotImpersonateIt) {
  constexpr char kToken[] = "shared-agent-token-0123456789";
  StartCoordinator(/*mutual=*/true, kToken);
  EXPECT_THAT(Log(), HasSubstr("agent ids bound to client certificates naming the agent id"));
  auto channel = [&](const std::string& cert, const std::string& key) {
    rpc::TlsOptions t = ClientTls(pki().ca, false);
    t.cert_file = cert;
    t.key_file = key;
    auto credentials = rpc::MakeChannelCredentials(t);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    return rpc::MakeChannel(address_, *credentials);
  };
  ServiceClient user(address_, 10'000, "", ClientTls(pki().ca, true));

  RawAgent victim(channel(pki().client_cert, pki().client_key));
  v1::AgentMessage hello;
  hello.mutable_hello()->set_agent_id("test-agent");
  hello.mutable_hello()->set_auth_token(kToken);
  hello.mutable_hello()->set_host("victim");
  hello.mutable_hello()->set_protocol_version(rpc::kProtocolVersion);
  v1::Gpu* gpu = hello.mutable_hello()->add_gpus();
  gpu->set_index(0);
  gpu->set_name("NVIDIA RTX PRO 6000");
  gpu->set_sm(120);
  gpu->set_memory_bytes(96LL << 30);
  ASSERT_TRUE(victim.Send(hello));
  ASSERT_TRUE(victim.Next().has_welcome());
  auto submitted = user.SubmitSweep(kSweep, "tls.yaml");
  ASSERT_TRUE(submitted.ok()) << submitted.status();
  v1::CoordinatorMessage assignment = victim.Next();
  ASSERT_TRUE(assignment.has_assignment()) << assignment.DebugString();
  const std::string trial = assignment.assignment().trial_id();
  const int attempt = assignment.assignment().attempt();

  // The attacker: the shared token, its own certificate (CN=attacker), the victim's id, and the
  // victim's trial claimed as running.
  {
    RawAgent attacker(channel(pki().attacker_cert, pki().attacker_key));
    v1::AgentMessage forged = hello;
    forged.mutable_hello()->set_host("attacker");
    v1::RunningTrial* running = forged.mutable_hello()->add_running();
    running->set_trial_id(trial);
    running->set_attempt(attempt);
    ASSERT_TRUE(attacker.Send(forged));
    v1::CoordinatorMessage m = attacker.Next();
    EXPECT_FALSE(m.has_welcome()) << m.DebugString();
    attacker.Result(trial, attempt, ValidResultJson(trial, attempt));
    const grpc::Status status = attacker.End();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("'test-agent' is not named by the client "
                                                  "certificate (it names 'attacker')"));
  }
  // Another certificate that does name the id, while the victim is connected: refused as a
  // conflict, never replacing the victim's stream.
  {
    RawAgent twin(channel(pki().twin_cert, pki().twin_key));
    ASSERT_TRUE(twin.Send(hello));
    EXPECT_FALSE(twin.Next().has_welcome());
    const grpc::Status status = twin.End();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("connected with another credential"));
  }
  EXPECT_EQ(server_->stats().identity_refused, 2);
  EXPECT_THAT(server_->MetricsText(),
              HasSubstr("infersweep_agent_identity_refused_total{reason=\"certificate\"} 1"));
  EXPECT_THAT(server_->MetricsText(),
              HasSubstr("infersweep_agent_identity_refused_total{reason=\"conflict\"} 1"));

  // The victim's stream is still the agent's: its result is acknowledged and stored.
  TrialResult genuine;
  genuine.trial_id = trial;
  genuine.attempt = attempt;
  genuine.status = TrialStatus::kOk;
  genuine.model = "preset:tiny-moe";
  genuine.config = {{"device", "cpu"}, {"matmul", "naive"}};
  genuine.device = "cpu";
  genuine.reason = "genuine";
  ASSERT_TRUE(victim.Result(trial, attempt, ToJson(genuine).dump()));
  v1::CoordinatorMessage ack = victim.Next();
  ASSERT_TRUE(ack.has_ack()) << ack.DebugString();
  auto stored = server_->store()->QueryResults(ResultQuery{});
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->size(), 1u);
  EXPECT_EQ((*stored)[0].agent_id, "test-agent");
  EXPECT_EQ((*stored)[0].result.reason, "genuine");
  EXPECT_TRUE(victim.End().ok());
}

TEST_F(Tls, CliClientFlags) {
  StartCoordinator(/*mutual=*/true);
  const std::string base = absl::StrCat(INFERSWEEP_BINARY, " agents --coordinator ", address_);
  int rc = -1;
  std::string out = RunCommand(
      absl::StrCat(base, " --tls-ca '", pki().ca, "' --tls-cert '", pki().client_cert,
                   "' --tls-key '", pki().client_key, "' 2>&1"),
      &rc);
  EXPECT_EQ(rc, 0) << out;
  out = RunCommand(absl::StrCat(base, " --tls-ca '", pki().ca, "' 2>&1"), &rc);
  EXPECT_NE(rc, 0) << out;
  out = RunCommand(absl::StrCat(base, " --tls-ca '", dir_, "/missing.pem' 2>&1"), &rc);
  EXPECT_NE(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr(dir_ + "/missing.pem"));
}

TEST_F(Tls, BadTlsFilesAreClearErrors) {
  const std::string missing = dir_ + "/missing.pem", empty = dir_ + "/empty.pem";
  { std::ofstream(empty) << "\n"; }

  // Server side.
  for (const std::string& bad : {missing, empty}) {
    rpc::TlsOptions t;
    t.cert_file = bad;
    t.key_file = pki().server_key;
    auto c = rpc::MakeServerCredentials(t);
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(bad));
  }
  {
    rpc::TlsOptions t;
    t.cert_file = pki().server_cert;  // no key
    EXPECT_EQ(rpc::MakeServerCredentials(t).status().code(), absl::StatusCode::kInvalidArgument);
    t = {};
    t.client_ca_file = pki().ca;  // mTLS without a server certificate
    EXPECT_EQ(rpc::MakeServerCredentials(t).status().code(), absl::StatusCode::kInvalidArgument);
    t = {};
    EXPECT_TRUE(rpc::MakeServerCredentials(t).ok());  // plaintext
  }
  // A key of another certificate, a file that is not a certificate, a CA file that holds none:
  // each names the file and what is wrong with it, before gRPC sees them.
  const std::string garbage = dir_ + "/garbage.pem";
  {
    std::ofstream(garbage)
        << "-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n";
  }
  const std::string cert_as_key = dir_ + "/cert-as-key.pem";
  std::filesystem::copy_file(pki().server_cert, cert_as_key);
  std::filesystem::permissions(cert_as_key, std::filesystem::perms::owner_read);
  const struct {
    std::string cert, key, client_ca, message;
  } pairs[] = {
      {pki().server_cert, pki().client_key, "",
       absl::StrCat("TLS private key file ", pki().client_key,
                    " does not match the certificate in ", pki().server_cert)},
      {garbage, pki().server_key, "",
       absl::StrCat("TLS certificate file ", garbage, " is not a PEM certificate")},
      {pki().server_cert, cert_as_key, "",
       absl::StrCat("TLS private key file ", cert_as_key, " is not an unencrypted PEM")},
      {pki().server_cert, pki().server_key, pki().server_key,
       absl::StrCat("TLS client CA file ", pki().server_key, " is not a PEM certificate")},
  };
  for (const auto& p : pairs) {
    rpc::TlsOptions t;
    t.cert_file = p.cert;
    t.key_file = p.key;
    t.client_ca_file = p.client_ca;
    auto c = rpc::MakeServerCredentials(t);
    ASSERT_FALSE(c.ok()) << p.message;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(p.message));
    rpc::TlsOptions client = ClientTls(pki().ca, false);
    client.cert_file = p.cert;
    client.key_file = p.key;
    if (p.client_ca.empty()) {
      auto cc = rpc::MakeChannelCredentials(client);
      ASSERT_FALSE(cc.ok()) << p.message;
      EXPECT_THAT(std::string(cc.status().message()), HasSubstr(p.message));
    }
  }
  // The command says it in one line and nothing of gRPC's, and exits 2 before binding.
  {
    int rc = -1;
    const std::string out =
        RunCommand(absl::StrCat(INFERSWEEP_BINARY,
                                " coordinator --listen 127.0.0.1:0 --metrics-listen= --db '", dir_,
                                "/cli.db' --tls-cert '", pki().server_cert, "' --tls-key '",
                                pki().client_key, "' 2>&1"),
                   &rc);
    EXPECT_NE(rc, 0) << out;
    EXPECT_THAT(out, HasSubstr("does not match the certificate in"));
    EXPECT_THAT(out, Not(HasSubstr("address in use")));
    EXPECT_THAT(out, Not(HasSubstr("ssl_transport_security")));
  }

  // The coordinator refuses to start on a bad file.
  {
    CoordinatorOptions o;
    o.log = [](const std::string&) {};
    o.tls.cert_file = pki().server_cert;
    o.tls.key_file = missing;
    CoordinatorServer server(o);
    auto port = server.Start("127.0.0.1:0", dir_ + "/c.db");
    ASSERT_FALSE(port.ok());
    EXPECT_THAT(std::string(port.status().message()), HasSubstr(missing));
  }

  // Client side: ServiceClient and the agent report the path.
  ServiceClient client("127.0.0.1:1", 1'000, "", ClientTls(missing, false));
  EXPECT_FALSE(client.tls_status().ok());
  auto r = client.ListSweeps();
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(missing));
  {
    rpc::TlsOptions t = ClientTls(pki().ca, false);
    t.cert_file = pki().client_cert;  // no key
    EXPECT_EQ(rpc::MakeChannelCredentials(t).status().code(), absl::StatusCode::kInvalidArgument);
  }
  AgentOptions ao;
  ao.coordinator = "127.0.0.1:1";
  ao.agent_id = "bad-tls";
  ao.spool_path = dir_ + "/bad.spool.db";
  ao.tls = ClientTls(empty, false);
  ao.log = [](const std::string&) {};
  Agent agent(ao);
  absl::Status s = agent.Start();
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr(empty));
}

}  // namespace
}  // namespace infersweep
